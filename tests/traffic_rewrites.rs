//! Path rewrites by regex (`regex_rewrite` on routes and redirects), checked with an echo
//! backend; the same cases run against Envoy with PORTICO_GATEWAY_BIN.

mod common;

use common::*;
use envoy_types::pb::envoy::config::route::v3::{redirect_action, route, RedirectAction};
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatchAndSubstitute, RegexMatcher};

const HOST: &str = "rewrite.example.com";

fn rr(pattern: &str, substitution: &str) -> RegexMatchAndSubstitute {
    RegexMatchAndSubstitute {
        pattern: Some(RegexMatcher {
            regex: pattern.into(),
            ..Default::default()
        }),
        substitution: substitution.into(),
    }
}

fn rewritten(cluster: &str, pattern: &str, substitution: &str) -> route::Action {
    let mut a = to_cluster(cluster);
    if let route::Action::Route(ra) = &mut a {
        ra.regex_rewrite = Some(rr(pattern, substitution));
    }
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regex_rewrite_rewrites_the_path_and_keeps_the_query() {
    let echo = EchoBackend::start("echo").await;
    let mesh = Mesh::start(|port| {
        let redirect = route::Action::Redirect(RedirectAction {
            path_rewrite_specifier: Some(redirect_action::PathRewriteSpecifier::RegexRewrite(rr(
                "^/redirect/*",
                "/",
            ))),
            ..Default::default()
        });
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "rw",
                    &[HOST],
                    vec![
                        rt(
                            prefix("/service/"),
                            rewritten("echo", r"^/service/([^/]+)(/.*)$", r"\2/instance/\1"),
                        ),
                        rt(prefix("/global/"), rewritten("echo", "o", "0")),
                        rt(
                            prefix("/dollar/"),
                            rewritten("echo", "^/dollar/(.*)$", "/$1/\\1"),
                        ),
                        rt(prefix("/redirect"), redirect),
                    ],
                )],
            )],
            clusters: vec![eds_cluster("echo")],
            endpoints: vec![cla("echo", &[echo.addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_status("/global/x", HOST, 200).await;
    let r = mesh.get("/service/foo/v1/api?x=1&y=2", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.header("x-echo-path"),
        Some("/v1/api/instance/foo?x=1&y=2")
    );
    let r = mesh.get("/global/foo/boo?o=o", HOST, &[]).await;
    assert_eq!(r.header("x-echo-path"), Some("/gl0bal/f00/b00?o=o"));
    // A `$` in the substitution is a literal, not a group reference.
    let r = mesh.get("/dollar/abc", HOST, &[]).await;
    assert_eq!(r.header("x-echo-path"), Some("/$1/abc"));
    let r = raw_head(mesh.port, "/redirect//a/b?q=1", HOST).await;
    assert_eq!(r.status, 301, "{r:?}");
    assert_eq!(
        r.header("location"),
        Some(format!("http://{HOST}/a/b?q=1").as_str())
    );
}
