//! Plain Envoy (no wasm filter) in front of the fleet: the override_host policy honours
//! `x-gateway-destination-endpoint`, and round-robins without it. Skipped when no Envoy
//! binary is installed (run scripts/setup.sh), unless TOKENAWARE_REQUIRE_ENVOY is set.

use std::collections::BTreeSet;
use std::time::Duration;

use wasm_tests::envoy::{have_envoy, Envoy, GatewayConfig};
use wasm_tests::fleet::{Fleet, FleetConfig};

#[tokio::test]
async fn override_host_header_and_round_robin_fallback() {
    if !have_envoy() {
        return;
    }
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(3, 0.01)).unwrap();
    let eps = fleet.endpoints();
    let envoy = tokio::task::spawn_blocking({
        let eps = eps.clone();
        move || Envoy::start(GatewayConfig::new(eps))
    })
    .await
    .unwrap()
    .unwrap();
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = envoy.url("/v1/completions");
    let body = r#"{"model":"sim-model","prompt":"hello","max_tokens":2}"#;

    for ep in eps.iter().rev().chain(eps.iter()) {
        let r = c
            .post(&url)
            .header("x-gateway-destination-endpoint", ep)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-fleet-endpoint"], ep.as_str());
    }

    let mut seen = BTreeSet::new();
    for _ in 0..12 {
        let r = c.post(&url).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        seen.insert(
            r.headers()["x-fleet-endpoint"]
                .to_str()
                .unwrap()
                .to_string(),
        );
    }
    assert_eq!(seen.len(), 3, "round robin reached {seen:?}");

    // Unknown host in the header: the fallback policy picks a real endpoint.
    let r = c
        .post(&url)
        .header("x-gateway-destination-endpoint", "127.0.0.1:1")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // The admin cluster exposes the endpoint list the filter can discover.
    let (status, clusters) = envoy.admin_get("/clusters?format=json").unwrap();
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&clusters).unwrap();
    let models = v["cluster_statuses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "models")
        .unwrap();
    let listed: BTreeSet<String> = models["host_statuses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            let a = &h["address"]["socket_address"];
            format!("{}:{}", a["address"].as_str().unwrap(), a["port_value"])
        })
        .collect();
    assert_eq!(listed, eps.iter().cloned().collect::<BTreeSet<_>>());
}
