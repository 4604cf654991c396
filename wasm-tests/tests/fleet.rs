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

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
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
        let r = c
            .post(format!("http://{ep}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-fleet-endpoint"], ep.as_str());
        let v: Value = r.json().await.unwrap();
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
