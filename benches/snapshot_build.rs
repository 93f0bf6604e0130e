//! Snapshot build for 10,000 EDS clusters x 10 endpoints: `cargo bench --bench snapshot_build`.

use std::sync::{Arc, OnceLock};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::core::v3::{
    address, config_source, socket_address, Address, AggregatedConfigSource, ApiVersion,
    ConfigSource, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::google::protobuf::{Any, Duration};
use envoy_types::util::pack_any;
use portico::admin::stats::Stats;
use portico::snapshot::Snapshot;
use portico::xds::store::Store;
use portico::xds::types::Kind;

const CLUSTERS: usize = 10_000;
const ENDPOINTS: usize = 10;
/// The cluster whose endpoint moves in the one-endpoint EDS change.
const CHANGED: usize = CLUSTERS / 2;

fn name(i: usize) -> String {
    format!("outbound|8080||svc{i}.default.svc.cluster.local")
}

/// An EDS cluster over ADS, as tests/common `eds_cluster` builds it.
fn eds_cluster(i: usize) -> Cluster {
    Cluster {
        name: name(i),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ConfigSource {
                config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
                    AggregatedConfigSource {},
                )),
                resource_api_version: ApiVersion::V3 as i32,
                ..Default::default()
            }),
            service_name: name(i),
        }),
        connect_timeout: Some(Duration {
            seconds: 1,
            nanos: 0,
        }),
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        ..Default::default()
    }
}

/// Cluster `i`'s endpoints: ENDPOINTS distinct pod IPs on port 8080 (`port0` for the first).
fn cla(i: usize, port0: u32) -> ClusterLoadAssignment {
    let lb_endpoints = (0..ENDPOINTS)
        .map(|j| {
            let n = i * ENDPOINTS + j;
            LbEndpoint {
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            address: format!("10.{}.{}.{}", n >> 16 & 255, n >> 8 & 255, n & 255),
                            port_specifier: Some(socket_address::PortSpecifier::PortValue(
                                if j == 0 { port0 } else { 8080 },
                            )),
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            }
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: name(i),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Built once per process: under `cargo test` the benches run once each in a debug build.
struct Fixture {
    cds: Vec<Any>,
    eds: Vec<Any>,
    /// One ClusterLoadAssignment: cluster CHANGED with its first endpoint on another port.
    one: Vec<Any>,
    after_cds: Store,
    /// After the CDS and EDS pushes, before any snapshot: every cluster still to build.
    full: Store,
    /// `full` once its snapshot is live: what changed is cleared, as `ConfigWorker::commit` does.
    committed: Store,
    snapshot: Snapshot,
    stats: Stats,
}

fn apply(store: &Store, kind: Kind, version: &str, resources: &[Any]) -> Store {
    store
        .apply(kind, version, resources)
        .unwrap_or_else(|e| panic!("bench {} push rejected: {e:?}", kind.short()))
}

/// (d): an EDS push of one assignment on top of the live store, then the next snapshot.
fn eds_change(f: &Fixture) -> (Store, Snapshot) {
    let next = apply(&f.committed, Kind::Endpoint, "eds-2", &f.one);
    let snap = next.assemble(&f.snapshot, 2, &f.stats);
    (next, snap)
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let cds: Vec<Any> = (0..CLUSTERS).map(|i| pack_any(eds_cluster(i))).collect();
        let eds: Vec<Any> = (0..CLUSTERS).map(|i| pack_any(cla(i, 8080))).collect();
        let one = vec![pack_any(cla(CHANGED, 9090))];
        let after_cds = apply(&Store::default(), Kind::Cluster, "cds-1", &cds);
        let full = apply(&after_cds, Kind::Endpoint, "eds-1", &eds);
        let stats = Stats::new();
        let snapshot = full.assemble(&Snapshot::default(), 1, &stats);
        assert_eq!(
            snapshot.clusters.len(),
            CLUSTERS,
            "every cluster is routable"
        );
        let mut committed = full.clone();
        committed.touched = Default::default();
        let f = Fixture {
            cds,
            eds,
            one,
            after_cds,
            full,
            committed,
            snapshot,
            stats,
        };
        // (d) must rebuild exactly one cluster and share the rest with the previous snapshot.
        let (_, next) = eds_change(&f);
        assert_eq!(next.clusters.len(), CLUSTERS);
        let rebuilt = next
            .clusters
            .iter()
            .filter(|(k, c)| !Arc::ptr_eq(c, &f.snapshot.clusters[*k]))
            .count();
        assert_eq!(rebuilt, 1, "a one-endpoint change rebuilds one cluster");
        f
    })
}

fn snapshot_build(c: &mut Criterion) {
    let mut g = c.benchmark_group(format!("snapshot_build/{CLUSTERS}x{ENDPOINTS}"));
    g.sample_size(10);
    g.warm_up_time(std::time::Duration::from_secs(1));
    g.measurement_time(std::time::Duration::from_secs(5));
    // Each routine returns what it built, so dropping it is left out of the time.
    g.bench_function("a_cds_apply", |b| {
        let f = fixture();
        let empty = Store::default();
        b.iter_batched(
            || (),
            |()| apply(&empty, Kind::Cluster, "cds-1", &f.cds),
            BatchSize::PerIteration,
        )
    });
    g.bench_function("b_eds_apply", |b| {
        let f = fixture();
        b.iter_batched(
            || (),
            |()| apply(&f.after_cds, Kind::Endpoint, "eds-1", &f.eds),
            BatchSize::PerIteration,
        )
    });
    // From scratch: no previous snapshot and fresh stats, as at startup.
    g.bench_function("c_assemble_full", |b| {
        let f = fixture();
        b.iter_batched(
            Stats::new,
            |stats| {
                let snap = f.full.assemble(&Snapshot::default(), 1, &stats);
                (snap, stats)
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function("d_one_endpoint_change", |b| {
        let f = fixture();
        b.iter_batched(|| (), |()| eds_change(f), BatchSize::PerIteration)
    });
    g.finish();
}

criterion_group!(benches, snapshot_build);
criterion_main!(benches);
