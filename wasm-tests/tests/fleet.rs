//! The simulated fleet over real HTTP: cold vs warm timing, cached_tokens, headers, metrics.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use wasm_tests::fleet::{Fleet, FleetConfig, MetricsNames, Timing};

fn fleet(endpoints: usize, names: MetricsNames) -> Fleet {
    Fleet::start_on_free_ports(FleetConfig {
        endpoints,
        timing: Timing {
            time_factor: 0.02,
            ..Default::default()
        },
        metrics_names: names,
        dead: vec![endpoints as u16 - 1], // last endpoint is dead
        ..Default::default()
    })
    .unwrap()
}

/// One endpoint with `timing`, and its completions URL.
fn one_endpoint(timing: Timing) -> (Fleet, String) {
    let f = Fleet::start_on_free_ports(FleetConfig {
        endpoints: 1,
        timing,
        ..Default::default()
    })
    .unwrap();
    let url = format!("http://{}/v1/completions", f.endpoints()[0]);
    (f, url)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// POSTs a completion to one endpoint; it answers 200, naming itself.
async fn complete(c: &reqwest::Client, ep: &str, body: &Value) -> reqwest::Response {
    let r = c
        .post(format!("http://{ep}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-fleet-endpoint"], ep);
    r
}

#[tokio::test]
async fn cold_then_warm_completion() {
    let f = fleet(3, MetricsNames::Vllm);
    let ep = &f.endpoints()[1];
    let c = client();
    // 55,000 tokens: cold prefill = 55000/20480 s × 0.02 ≈ 54 ms; warm ≈ 0.
    let body = json!({"model": "sim-model", "prompt": "A".repeat(220_000), "max_tokens": 4});
    let mut times = Vec::new();
    let mut usages = Vec::new();
    for _ in 0..2 {
        let t0 = Instant::now();
        let v: Value = complete(&c, ep, &body).await.json().await.unwrap();
        times.push(t0.elapsed());
        usages.push(v["usage"].clone());
    }
    assert_eq!(usages[0]["prompt_tokens"], 55_000);
    assert_eq!(usages[0]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usages[1]["prompt_tokens_details"]["cached_tokens"], 54_992);
    assert!(times[0] >= Duration::from_millis(50), "cold {:?}", times[0]);
    assert!(
        times[1] < times[0],
        "warm {:?} cold {:?}",
        times[1],
        times[0]
    );

    let m = c
        .get(format!("http://{ep}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("vllm:prefix_cache_hits_total{model_name=\"sim-model\"} 54992.0"),
        "{m}"
    );
    assert!(m.contains("num_gpu_blocks=\"32768\""));
    assert!(m.contains("# TYPE vllm:num_requests_waiting gauge"));
}

/// With `slow_endpoints: 1` the first endpoint prefills at half the rate: the same cold
/// prompt takes about twice as long there.
#[tokio::test]
async fn slow_endpoints_prefill_at_half_rate() {
    let f = Fleet::start_on_free_ports(FleetConfig {
        endpoints: 2,
        timing: Timing {
            time_factor: 0.1,
            ..Default::default()
        },
        slow_endpoints: 1,
        ..Default::default()
    })
    .unwrap();
    let c = client();
    let mut times = Vec::new();
    for (i, ep) in f.endpoints().iter().enumerate() {
        // 20,480 cold tokens: 1 s model at the fleet's rate, 100 ms wall; distinct text per
        // endpoint (each cache is its own anyway).
        let body =
            json!({"model": "sim-model", "prompt": format!("{i}").repeat(81_920), "max_tokens": 1});
        let t0 = Instant::now();
        complete(&c, ep, &body).await.bytes().await.unwrap();
        times.push(t0.elapsed().as_secs_f64());
    }
    let (slow, fast) = (times[0], times[1]);
    assert!(fast >= 0.095, "fast endpoint {fast} s");
    // HTTP overhead adds to both: the ratio stays a little under 2 on a busy machine.
    assert!(
        slow > 1.5 * fast && slow < 2.6 * fast,
        "slow {slow} s, fast {fast} s"
    );
}

#[tokio::test]
async fn streaming_chat_ends_with_usage_and_done() {
    let f = fleet(2, MetricsNames::Vllm);
    let ep = &f.endpoints()[0];
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 5});
    let r = client()
        .post(format!("http://{ep}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(r.headers()["x-fleet-endpoint"], ep.as_str());
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(events.len(), 6, "{text}");
    assert_eq!(events[5], "[DONE]");
    let last: Value = serde_json::from_str(events[4]).unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 5);
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let first: Value = serde_json::from_str(events[0]).unwrap();
    assert!(first.get("usage").is_none());
}

#[tokio::test]
async fn control_endpoints_dead_port_and_sglang_names() {
    let f = fleet(2, MetricsNames::Sglang);
    let (live, dead) = (&f.endpoints()[0], &f.endpoints()[1]);
    let c = client();
    let get = |path: &str| c.get(format!("http://{live}{path}")).send();
    assert_eq!(get("/health").await.unwrap().status(), 200);
    assert_eq!(get("/nope").await.unwrap().status(), 404);
    let models: Value = get("/v1/models").await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "sim-model");
    let m = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        m.contains("sglang:num_queue_reqs{model_name=\"sim-model\"} 0.0"),
        "{m}"
    );
    assert!(!m.contains("vllm:"));

    let custom = "vllm:num_requests_waiting{model_name=\"sim-model\"} 42.0\n";
    let ov = format!("http://{live}/fleet/metrics-override");
    assert!(c
        .post(&ov)
        .body(custom)
        .send()
        .await
        .unwrap()
        .status()
        .is_success());
    assert_eq!(get("/metrics").await.unwrap().text().await.unwrap(), custom);
    c.post(&ov).body("").send().await.unwrap();
    assert!(get("/metrics")
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
        .contains("sglang:"));

    assert!(c.get(format!("http://{dead}/health")).send().await.is_err());
}

/// Time to the first streamed body byte of a streaming completion.
async fn ttft(
    c: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_tokens: usize,
) -> (Duration, Value) {
    let t0 = Instant::now();
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    let mut r = c.post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    let ttft = t0.elapsed();
    let mut text = String::from_utf8_lossy(&first).into_owned();
    while let Some(c) = r.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    let usage = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").cloned())
        .unwrap();
    (ttft, usage)
}

/// The scheduler against its own model: on an idle endpoint a cold 55k-token prompt takes
/// 55k / R_peak (in 8,192-token chunks), a warm one only its uncached part, within 10 %.
#[tokio::test]
async fn cold_and_warm_prefill_match_the_model() {
    // Real time: the fixed cost below is noisy on a loaded machine; model times dominate it.
    let tf = 1.0;
    let (_fleet, url) = one_endpoint(Timing {
        time_factor: tf,
        ..Default::default()
    });
    let c = client();
    // The fixed cost of a request this size (client, HTTP, JSON, block hashing; large in a
    // debug build) is measured by sending the same prompt again: then only its last partial
    // block (8 tokens) is prefilled. It is subtracted before comparing with the model.
    let prefix = "p".repeat(55_000 * 4);
    let (cold, u) = ttft(&c, &url, &prefix, 1).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    let (again, u) = ttft(&c, &url, &prefix, 1).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 54_992);
    let fixed = again.as_secs_f64() - 8.0 / 20_480.0 * tf;
    let want = 55_000.0 / 20_480.0 * tf;
    let got = cold.as_secs_f64() - fixed;
    assert!(
        (got - want).abs() <= 0.1 * want,
        "cold {got:.3} s, model {want:.3} s (fixed cost {fixed:.3} s)"
    );
    // Warm: the 55k prefix plus 10,000 new tokens; only the part past the cached full blocks
    // (3,437 blocks = 54,992 tokens) is prefilled, in two chunks.
    let prompt = format!("{prefix}{}", "q".repeat(10_000 * 4));
    let (warm, u) = ttft(&c, &url, &prompt, 1).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 54_992);
    let (again, _) = ttft(&c, &url, &prompt, 1).await;
    let fixed = again.as_secs_f64() - 8.0 / 20_480.0 * tf;
    let want = (65_000.0 - 54_992.0) / 20_480.0 * tf;
    let got = warm.as_secs_f64() - fixed;
    assert!(
        (got - want).abs() <= 0.1 * want,
        "warm {got:.3} s, model {want:.3} s (fixed cost {fixed:.3} s)"
    );
    assert!(fixed < want, "fixed cost {fixed:.3} s is not small");
}

/// max-num-seqs: a second request waits until the first leaves the batch; decode steps
/// with many requests are slower than with one.
#[tokio::test]
async fn max_num_seqs_queues_and_decode_slows_with_the_batch() {
    let (f, url) = one_endpoint(Timing {
        time_factor: 1.0,
        decode_ms_per_token: 10.0,
        max_num_seqs: 1,
        ..Default::default()
    });
    let c = client();
    let t0 = Instant::now();
    let (a, b) = tokio::join!(ttft(&c, &url, "a", 20), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        ttft(&c, &url, "b", 1).await
    });
    assert!(a.0 < Duration::from_millis(30), "{:?}", a.0);
    // b waits for a's 19 decode steps (190 ms) before it is admitted.
    assert!(b.0 >= Duration::from_millis(150), "{:?}", b.0);
    assert!(t0.elapsed() < Duration::from_secs(2));
    drop(f);

    let (_wide, url) = one_endpoint(Timing {
        time_factor: 1.0,
        decode_ms_per_token: 2.0,
        decode_batch_slope: 0.05,
        ..Default::default()
    });
    let alone = Instant::now();
    ttft(&c, &url, "x", 50).await;
    let alone = alone.elapsed();
    let batch = Instant::now();
    let all: Vec<_> = (0..40)
        .map(|i| ttft(&c, &url, if i % 2 == 0 { "y" } else { "z" }, 50))
        .collect();
    futures_util::future::join_all(all).await;
    let batch = batch.elapsed();
    // 40 decoding requests: each step takes 1 + 0.05 × 39 ≈ 2.95× as long.
    assert!(batch > alone * 2, "alone {alone:?}, batch of 40 {batch:?}");
}

/// Scaled, a decode-only step stands for ten engine steps (token scale 0.1): a prompt that
/// arrives during one is admitted at the next engine step (20 ms here), not when the whole
/// simulated token (200 ms) is done, and the decoder still takes its modelled time.
#[tokio::test]
async fn a_request_joins_a_scaled_decode_step_at_the_next_engine_step() {
    let (_fleet, url) = one_endpoint(Timing {
        time_factor: 1.0,
        decode_ms_per_token: 200.0,
        token_scale: 0.1,
        ..Default::default()
    });
    let c = client();
    let t0 = Instant::now();
    let (_, (b, _)) = tokio::join!(ttft(&c, &url, "a", 6), async {
        tokio::time::sleep(Duration::from_millis(60)).await;
        ttft(&c, &url, "b", 1).await
    });
    // b came about 60 ms into a's first 200 ms decode step: it waits for the current
    // engine step (at most 20 ms) and one prefill step, not the rest of the 200 ms.
    assert!(b < Duration::from_millis(110), "b's TTFT {b:?}");
    // a's five decode tokens still take five simulated tokens' time (1 s).
    let a_total = t0.elapsed();
    assert!(
        a_total >= Duration::from_millis(950) && a_total < Duration::from_millis(1_600),
        "a took {a_total:?}"
    );
}

/// The KV pool is shared as in vLLM: a request waits while running ones reserve the room it
/// needs, and what they reserve is taken from the prefix cache.
#[tokio::test]
async fn running_requests_hold_the_kv_pool() {
    let start = |kv_blocks| {
        Fleet::start_on_free_ports(FleetConfig {
            endpoints: 1,
            timing: Timing {
                time_factor: 1.0,
                decode_ms_per_token: 3.0,
                ..Default::default()
            },
            kv_blocks,
            ..Default::default()
        })
        .unwrap()
    };
    let c = client();
    // a reserves 1 + 160 tokens (11 blocks) and b 6 more: with 12 blocks b waits for a's
    // 159 decode steps (about 0.48 s); with room for both it does not.
    let pair = |url: String| {
        let c = c.clone();
        async move {
            let (_, (b, _)) = tokio::join!(ttft(&c, &url, "a", 160), async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                ttft(&c, &url, "b", 80).await
            });
            b
        }
    };
    let roomy = start(64);
    let free = pair(format!("http://{}/v1/completions", roomy.endpoints()[0])).await;
    assert!(free < Duration::from_millis(200), "{free:?}");
    let tight = start(12);
    let url = format!("http://{}/v1/completions", tight.endpoints()[0]);
    let waited = pair(url.clone()).await;
    assert!(waited >= Duration::from_millis(350), "{waited:?}");

    // A 64-token prompt is cached (4 blocks) ...
    let prompt = "p".repeat(64 * 4 + 4);
    let cached = |u: &Value| u["prompt_tokens_details"]["cached_tokens"].clone();
    ttft(&c, &url, &prompt, 1).await;
    assert_eq!(cached(&ttft(&c, &url, &prompt, 1).await.1), 64);
    // ... until a request reserving the whole pool (1 + 191 tokens) pushes it out.
    ttft(&c, &url, "q", 191).await;
    assert_eq!(cached(&ttft(&c, &url, &prompt, 1).await.1), 0);
}

/// As in vLLM v1, a prompt's blocks join the cache as their chunks are scheduled: a request
/// for the same prefix admitted during its cold fill finds the chunks scheduled so far, not
/// nothing (and not the whole prefix, which is not computed yet).
#[tokio::test]
async fn a_request_admitted_during_a_cold_fill_finds_the_chunks_scheduled_so_far() {
    // Half speed: 55,000 tokens prefill in 1.34 s of wall time, in steps of 8,192 tokens
    // (0.2 s each).
    let (_f, url) = one_endpoint(Timing {
        time_factor: 0.5,
        ..Default::default()
    });
    let c = client();
    let body = json!({"model": "sim-model", "prompt": "B".repeat(220_000), "max_tokens": 1});
    let first = {
        let (c, url, body) = (c.clone(), url.clone(), body.clone());
        tokio::spawn(async move {
            let v: Value = c.post(url).json(&body).send().await?.json().await?;
            Ok::<_, reqwest::Error>((v, Instant::now()))
        })
    };
    tokio::time::sleep(Duration::from_millis(450)).await;
    let sent = Instant::now();
    let second: Value = c
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (first, first_done) = first.await.unwrap().unwrap();
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached(&first), Some(0));
    assert!(
        first_done > sent,
        "the first prefill ended before the second was sent"
    );
    let part = cached(&second).unwrap_or(0);
    assert!(
        (8_192..54_992).contains(&part),
        "cached {part} of 55,000 tokens"
    );
}
