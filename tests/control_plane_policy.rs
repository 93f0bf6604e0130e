//! Edge policy end to end from YAML: a RequestAuthentication, an ALLOW AuthorizationPolicy
//! on its request principals and a CUSTOM one calling the mesh config's HTTP ext_authz
//! provider, in `portico control-plane`'s directory, protect the demo's /reviews route on a
//! gateway (Portico, or Envoy with PORTICO_GATEWAY_BIN) configured by it.

mod common;
mod control_plane_support;

use bytes::Bytes;
use common::jwt::{now, Signer};
use common::*;
use control_plane_support::*;
use http_body_util::Full;
use serde_json::json;

const LABELS: [(&str, &str); 1] = [("istio", "ingressgateway")];
const ISSUER: &str = "https://issuer.example";

/// The authorization server: refuses everything it is asked about with 403 and a reason.
async fn refusing_authz() -> std::net::SocketAddr {
    serve_fn(|_req| {
        hyper::Response::builder()
            .status(403)
            .header("x-authz", "refused")
            .body(Full::new(Bytes::from_static(b"no secrets here")))
            .expect("response")
    })
    .await
}

fn policies(jwks: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: ConfigMap
metadata: {{ name: istio, namespace: istio-system }}
data:
  mesh: |
    extensionProviders:
    - name: authz
      envoyExtAuthzHttp:
        service: authz.default.svc.cluster.local
        port: 8000
        headersToDownstreamOnDeny: [x-authz]
---
apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: {{ name: jwt, namespace: istio-system }}
spec:
  selector: {{ matchLabels: {{ istio: ingressgateway }} }}
  jwtRules:
  - issuer: {ISSUER}
    jwks: '{jwks}'
    outputClaimToHeaders: [{{ header: x-user, claim: sub }}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{ name: need-token, namespace: istio-system }}
spec:
  selector: {{ matchLabels: {{ istio: ingressgateway }} }}
  rules:
  - from: [{{ source: {{ requestPrincipals: ["{ISSUER}/*"] }} }}]
    to: [{{ operation: {{ paths: ["/reviews/*"] }} }}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{ name: secrets, namespace: istio-system }}
spec:
  selector: {{ matchLabels: {{ istio: ingressgateway }} }}
  action: CUSTOM
  provider: {{ name: authz }}
  rules:
  - to: [{{ operation: {{ paths: ["/reviews/secret*"] }} }}]
"#
    )
}

#[tokio::test]
async fn yaml_policies_protect_the_demo_route() {
    let tmp = TempDir::new("portico-cp-policy");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let v1 = Backend::start("reviews-v1").await;
    let authz = refusing_authz().await;
    let gw_port = free_port();
    write_config(
        &dir,
        gw_port,
        &[("reviews-v1", "v1", v1.addr.port())],
        &[("v1", 100)],
    );
    let signer = Signer::new();
    write(
        &dir,
        "authz-service.yaml",
        &service_at("authz", 8000, "http", authz.port()),
    );
    write(&dir, "policies.yaml", &policies(&signer.jwks("k1")));

    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    let url = format!("http://127.0.0.1:{gw_port}/reviews/1");
    let client = HttpClient::new();
    let token = signer.token(
        "k1",
        json!({"iss": ISSUER, "sub": "alice", "exp": now() + 600}),
    );
    let bearer = format!("Bearer {token}");
    // With a good token the route is served.
    eventually("a token is let through", PROPAGATION, || {
        let (client, url, bearer) = (client.clone(), url.clone(), bearer.clone());
        async move {
            let r = client
                .get(&url, None, &[("authorization", bearer.as_str())])
                .await;
            match r.backend() {
                Some("reviews-v1") => Ok(()),
                _ => Err(format!("{} {:?}", r.status, r.body)),
            }
        }
    })
    .await;

    // Without one, the ALLOW policy's principal is missing: RBAC refuses.
    let r = client.get(&url, None, &[]).await;
    assert_eq!((r.status, r.body.as_str()), (403, "RBAC: access denied"));
    // A bad token: jwt_authn refuses first.
    let forged = Signer::new().token(
        "k1",
        json!({"iss": ISSUER, "sub": "mallory", "exp": now() + 600}),
    );
    let r = client
        .get(
            &url,
            None,
            &[("authorization", &format!("Bearer {forged}"))],
        )
        .await;
    assert_eq!((r.status, r.body.as_str()), (401, "Jwt verification fails"));
    // The CUSTOM policy's paths go to the authorization server, which refuses them.
    let secret = format!("http://127.0.0.1:{gw_port}/reviews/secret/1");
    let r = client
        .get(&secret, None, &[("authorization", bearer.as_str())])
        .await;
    assert_eq!((r.status, r.body.as_str()), (403, "no secrets here"));
    assert_eq!(r.header("x-authz"), Some("refused"));
}
