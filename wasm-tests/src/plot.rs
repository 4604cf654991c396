//! SVG plots of the benchmark's `results.json`: one file per workload, three panels against
//! the offered rate (TTFT p90 on a log axis with the SLO drawn in, input tokens/s, prefix-cache
//! hit rate), one line per target. Only plotters' SVG backend is used (no font files: text is
//! left to the SVG viewer), so the plots build and render anywhere.
//!
//! ```no_run
//! let set = wasm_tests::plot::ResultSet::load(&["target/bench/results.json".into()])?;
//! let written = set.write_svgs(&["target/bench/plots".into()])?;
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use serde::Deserialize;

/// One ladder stage of one target (the fields of a `runs` row the plots use).
#[derive(Debug, Clone, Deserialize)]
pub struct Run {
    pub target: String,
    pub workload: String,
    pub rate: f64,
    pub ttft_p90_s: f64,
    pub hit_rate: f64,
    pub input_tok_s: f64,
}

/// A workload's run parameters (only the SLO is drawn).
#[derive(Debug, Clone, Deserialize)]
pub struct Profile {
    pub workload: String,
    pub slo_s: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct ResultsFile {
    #[serde(default)]
    runs: Vec<Run>,
    #[serde(default)]
    profiles: Vec<Profile>,
}

/// Runs and profiles from one or more `results.json` files.
#[derive(Debug, Clone, Default)]
pub struct ResultSet {
    pub runs: Vec<Run>,
    pub profiles: Vec<Profile>,
}

/// Target colours, in the order targets first appear.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xed, 0xc9, 0x48),
];

const FONT: &str = "sans-serif";

impl ResultSet {
    /// Reads `results.json` files in order. A workload that appears in a later file replaces
    /// that workload's runs and profile from the earlier ones (a re-run of one workload on top
    /// of a full run).
    pub fn load(paths: &[PathBuf]) -> anyhow::Result<ResultSet> {
        let mut set = ResultSet::default();
        for p in paths {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            let file: ResultsFile =
                serde_json::from_str(&text).with_context(|| format!("parse {}", p.display()))?;
            set.merge(file.runs, file.profiles);
        }
        Ok(set)
    }

    /// Adds runs and profiles; workloads present in `runs` replace earlier ones.
    pub fn merge(&mut self, runs: Vec<Run>, profiles: Vec<Profile>) {
        let replaced: Vec<String> = runs.iter().map(|r| r.workload.clone()).collect();
        self.runs.retain(|r| !replaced.contains(&r.workload));
        self.profiles.retain(|p| {
            !replaced.contains(&p.workload) && !profiles.iter().any(|q| q.workload == p.workload)
        });
        self.runs.extend(runs);
        self.profiles.extend(profiles);
    }

    /// Workloads in the order they first appear.
    pub fn workloads(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.workload) {
                out.push(r.workload.clone());
            }
        }
        out
    }

    /// The SVG for one workload (empty workloads give an SVG with empty panels).
    pub fn render(&self, workload: &str) -> anyhow::Result<String> {
        let mut by_target: BTreeMap<usize, (String, Vec<&Run>)> = BTreeMap::new();
        let mut order: Vec<String> = Vec::new();
        for r in self.runs.iter().filter(|r| r.workload == workload) {
            let i = match order.iter().position(|t| *t == r.target) {
                Some(i) => i,
                None => {
                    order.push(r.target.clone());
                    order.len() - 1
                }
            };
            by_target
                .entry(i)
                .or_insert_with(|| (r.target.clone(), Vec::new()))
                .1
                .push(r);
        }
        let mut series: Vec<Series> = by_target
            .into_iter()
            .map(|(i, (name, mut runs))| {
                runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
                Series {
                    name,
                    colour: COLOURS[i % COLOURS.len()],
                    runs: runs.into_iter().cloned().collect(),
                }
            })
            .collect();
        series.retain(|s| !s.runs.is_empty());
        let slo = self
            .profiles
            .iter()
            .find(|p| p.workload == workload)
            .map(|p| p.slo_s)
            .filter(|s| s.is_finite() && *s > 0.0);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (1500, 480)).into_drawing_area();
            root.fill(&WHITE).map_err(plot_err)?;
            let root = root
                .titled(
                    &format!("{workload}: rate ladder (model time)"),
                    (FONT, 22).into_font(),
                )
                .map_err(plot_err)?;
            let (plots, key) = root.split_horizontally(1290);
            draw_key(&key, &series, slo)?;
            let panels = plots.split_evenly((1, 3));
            let rates: Vec<f64> = series
                .iter()
                .flat_map(|s| s.runs.iter().map(|r| r.rate))
                .collect();
            let x_max = rates.iter().copied().fold(1.0, f64::max) * 1.05;
            // TTFT p90, log axis covering the data and the SLO.
            let ttfts = series
                .iter()
                .flat_map(|s| s.runs.iter().map(|r| r.ttft_p90_s))
                .chain(slo)
                .filter(|v| *v > 0.0 && v.is_finite());
            let lo = ttfts.clone().fold(f64::INFINITY, f64::min);
            let hi = ttfts.fold(0.0, f64::max);
            // Whole decades, so the log axis labels 0.1, 1, 10, ...
            let (lo, hi) = if lo.is_finite() && hi > 0.0 {
                (
                    10f64.powf(lo.log10().floor()),
                    10f64.powf((hi * 1.01).log10().ceil()),
                )
            } else {
                (0.01, 10.0)
            };
            draw_panel(
                &panels[0],
                "TTFT p90 (s, log)",
                0.0..x_max,
                (lo..hi).log_scale(),
                &series,
                |r| r.ttft_p90_s.max(lo),
                slo,
                |v| format_si(*v),
            )?;
            let tput_max = series
                .iter()
                .flat_map(|s| s.runs.iter().map(|r| r.input_tok_s))
                .fold(1.0, f64::max)
                * 1.1;
            draw_panel(
                &panels[1],
                "input tokens/s",
                0.0..x_max,
                0.0..tput_max,
                &series,
                |r| r.input_tok_s,
                None,
                |v| format_si(*v),
            )?;
            draw_panel(
                &panels[2],
                "prefix-cache hit rate (%)",
                0.0..x_max,
                0.0..100.0,
                &series,
                |r| r.hit_rate * 100.0,
                None,
                |v| format!("{v:.0}"),
            )?;
            root.present().map_err(plot_err)?;
        }
        Ok(svg)
    }

    /// Writes `<workload>.svg` for every workload into each of `dirs` (created if missing);
    /// returns the files written.
    pub fn write_svgs(&self, dirs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
        let mut written = Vec::new();
        for w in self.workloads() {
            let svg = self.render(&w)?;
            for d in dirs {
                std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
                let path = d.join(format!("{}.svg", file_stem(&w)));
                std::fs::write(&path, &svg).with_context(|| format!("write {}", path.display()))?;
                written.push(path);
            }
        }
        Ok(written)
    }
}

struct Series {
    name: String,
    colour: RGBColor,
    runs: Vec<Run>,
}

/// One panel: a line and points per target against the rate, optionally the SLO as a grey
/// line.
#[allow(clippy::too_many_arguments)]
fn draw_panel<Y>(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    x: std::ops::Range<f64>,
    y: Y,
    series: &[Series],
    value: impl Fn(&Run) -> f64,
    slo: Option<f64>,
    y_fmt: impl Fn(&f64) -> String,
) -> anyhow::Result<()>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let x_end = x.end;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 17).into_font())
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("offered rate (req/s)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&y_fmt)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(plot_err)?;
    if let Some(s) = slo {
        chart
            .draw_series(LineSeries::new(
                [(0.0, s), (x_end, s)],
                ShapeStyle::from(&RGBColor(0x88, 0x88, 0x88)).stroke_width(1),
            ))
            .map_err(plot_err)?;
    }
    for s in series {
        let pts: Vec<(f64, f64)> = s.runs.iter().map(|r| (r.rate, value(r))).collect();
        let colour = s.colour;
        chart
            .draw_series(LineSeries::new(
                pts.clone(),
                ShapeStyle::from(&colour).stroke_width(2),
            ))
            .map_err(plot_err)?;
        chart
            .draw_series(
                pts.iter()
                    .map(|&p| Circle::new(p, 3, ShapeStyle::from(&colour).filled())),
            )
            .map_err(plot_err)?;
    }
    Ok(())
}

/// The legend, in its own column right of the panels (so it never hides a line).
fn draw_key(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    series: &[Series],
    slo: Option<f64>,
) -> anyhow::Result<()> {
    let grey = RGBColor(0x88, 0x88, 0x88);
    let mut rows: Vec<(String, RGBColor, u32)> = series
        .iter()
        .map(|s| (s.name.clone(), s.colour, 3))
        .collect();
    if let Some(s) = slo {
        rows.push((format!("TTFT SLO {s:.2} s"), grey, 1));
    }
    let font = (FONT, 14).into_font();
    for (i, (name, colour, width)) in rows.into_iter().enumerate() {
        let y = 80 + 24 * i as i32;
        area.draw(&PathElement::new(
            vec![(4, y), (28, y)],
            ShapeStyle::from(&colour).stroke_width(width),
        ))
        .map_err(plot_err)?;
        area.draw(&Text::new(name, (34, y - 7), font.clone()))
            .map_err(plot_err)?;
    }
    Ok(())
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plot: {e}")
}

/// 1234567 → "1.2M", 250000 → "250k", 0.25 → "0.25".
fn format_si(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// A workload name as a file stem (anything but `[A-Za-z0-9-_]` becomes `_`).
fn file_stem(w: &str) -> String {
    w.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(target: &str, workload: &str, rate: f64, p90: f64, hit: f64) -> Run {
        Run {
            target: target.into(),
            workload: workload.into(),
            rate,
            ttft_p90_s: p90,
            hit_rate: hit,
            input_tok_s: rate * 10_000.0,
        }
    }

    fn synthetic() -> ResultSet {
        let mut set = ResultSet::default();
        let mut runs = Vec::new();
        for (t, slope) in [("envoy-round-robin", 2.0), ("tokenaware-prefill", 0.5)] {
            for rate in [5.0, 10.0, 20.0] {
                runs.push(run(t, "b2b-saas", rate, 0.1 * slope * rate, 0.3 / slope));
            }
        }
        runs.push(run("envoy-round-robin", "seed-sim", 4.0, 6.0, 0.12));
        // A zero TTFT must not break the log axis.
        runs.push(run("smg-cache-aware", "seed-sim", 8.0, 0.0, 0.9));
        set.merge(
            runs,
            vec![Profile {
                workload: "b2b-saas".into(),
                slo_s: 0.7,
            }],
        );
        set
    }

    #[test]
    fn writes_one_svg_per_workload_with_every_target() {
        let dir = std::env::temp_dir().join(format!("tokenaware-plot-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let set = synthetic();
        let files = set
            .write_svgs(&[dir.join("a"), dir.join("b")])
            .expect("plots written");
        assert_eq!(files.len(), 4, "{files:?}");
        let b2b = std::fs::read_to_string(dir.join("a/b2b-saas.svg")).expect("b2b-saas.svg");
        assert!(b2b.contains("<svg"));
        for name in [
            "envoy-round-robin",
            "tokenaware-prefill",
            "TTFT SLO 0.70 s",
            "b2b-saas",
        ] {
            assert!(b2b.contains(name), "{name} missing");
        }
        assert!(!b2b.contains("smg-cache-aware"));
        let seed = std::fs::read_to_string(dir.join("b/seed-sim.svg")).expect("seed-sim.svg");
        assert!(seed.contains("<svg") && seed.contains("smg-cache-aware"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_later_file_replaces_a_workload() {
        let mut set = synthetic();
        set.merge(
            vec![run("tokenaware-decode", "b2b-saas", 60.0, 0.1, 0.99)],
            vec![Profile {
                workload: "b2b-saas".into(),
                slo_s: 2.0,
            }],
        );
        let b2b: Vec<&Run> = set
            .runs
            .iter()
            .filter(|r| r.workload == "b2b-saas")
            .collect();
        assert_eq!(b2b.len(), 1);
        assert_eq!(
            set.runs.iter().filter(|r| r.workload == "seed-sim").count(),
            2
        );
        assert_eq!(set.profiles.len(), 1);
        assert_eq!(set.workloads(), vec!["seed-sim", "b2b-saas"]);
        assert_eq!(format_si(1_234_567.0), "1.2M");
        assert_eq!(format_si(250_000.0), "250k");
        assert_eq!(format_si(0.25), "0.25");
        assert_eq!(file_stem("a/b c"), "a_b_c");
    }

    #[test]
    fn loads_a_results_file() {
        let dir = std::env::temp_dir().join(format!("tokenaware-plot-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("results.json");
        let json = serde_json::json!({
            "runs": [{"target": "t", "workload": "w", "rate": 1.0, "completed": 3, "errors": 0,
                      "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "hit_rate": 0.5, "input_tok_s": 9.0,
                      "output_tok_s": 1.0, "e2e_p50_s": 1.0, "per_endpoint": [3]}],
            "profiles": [{"workload": "w", "scale": 0.1, "time_factor": 0.5, "rates": [1.0],
                          "stage_duration": 20.0, "slo_s": 0.7}],
            "capacity": [], "skipped": []
        });
        std::fs::write(&path, json.to_string()).expect("write");
        let set = ResultSet::load(&[path]).expect("load");
        assert_eq!(set.runs.len(), 1);
        assert_eq!(set.profiles[0].slo_s, 0.7);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
