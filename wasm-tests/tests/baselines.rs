//! The benchmark's Envoy baselines (no filter): least request and ring hash on
//! `x-prefix-group` as the `models` cluster's fallback policy. Skipped when no Envoy binary
//! is installed, unless TOKENAWARE_REQUIRE_ENVOY is set.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use wasm_tests::envoy::{have_envoy, Envoy, FallbackLb, GatewayConfig, PREFIX_GROUP_HEADER};
use wasm_tests::fleet::{Fleet, FleetConfig};

async fn served_by(c: &reqwest::Client, url: &str, group: Option<&str>) -> String {
    let body = r#"{"model":"sim-model","prompt":"hello","max_tokens":2}"#;
    let mut req = c.post(url).body(body);
    if let Some(g) = group {
        req = req.header(PREFIX_GROUP_HEADER, g);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.headers()["x-fleet-endpoint"]
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn least_request_and_ring_hash_on_prefix_group() {
    if !have_envoy() {
        return;
    }
    let fleet = Fleet::start_on_free_ports(FleetConfig::scaled(4, 0.01)).unwrap();
    let eps = fleet.endpoints();
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    let cfg = GatewayConfig::new(eps.clone()).with_lb(FallbackLb::RingHashPrefixGroup);
    let envoy = tokio::task::spawn_blocking(move || Envoy::start(cfg))
        .await
        .unwrap()
        .unwrap();
    let url = envoy.url("/v1/completions");
    // Each group sticks to one endpoint; 24 groups spread over more than one.
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for round in 0..3 {
        for g in 0..24 {
            let g = format!("g{g}");
            let ep = served_by(&c, &url, Some(&g)).await;
            if round == 0 {
                owner.insert(g, ep);
            } else {
                assert_eq!(owner[&g], ep, "group {g} moved");
            }
        }
    }
    let used: BTreeSet<&String> = owner.values().collect();
    assert!(used.len() >= 2, "ring hash used {used:?}");
    drop(envoy);

    let cfg = GatewayConfig::new(eps.clone()).with_lb(FallbackLb::LeastRequest);
    let envoy = tokio::task::spawn_blocking(move || Envoy::start(cfg))
        .await
        .unwrap()
        .unwrap();
    let url = envoy.url("/v1/completions");
    let mut seen = BTreeSet::new();
    for _ in 0..40 {
        seen.insert(served_by(&c, &url, None).await);
    }
    assert!(seen.len() >= 3, "least request reached {seen:?}");
}
