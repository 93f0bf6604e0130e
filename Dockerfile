# Multi-stage build: compile with the Rust toolchain, ship a slim non-root runtime.
#
#   docker build -t portico .                                   # standalone (the last stage)
#   docker build --target proxyv2 -t portico-proxyv2:1.30.0 .   # Istio's proxyv2 with Portico
#
# The proxyv2 target keeps Istio's image whole (pilot-agent, its entrypoint, the bootstrap
# template, user 1337) and puts Portico where pilot-agent starts Envoy. The build stage is
# Debian bookworm (glibc 2.36): the binary runs on proxyv2's ubuntu:noble base (2.39) and on
# its distroless variant (bookworm).
ARG ISTIO_VERSION=1.30.0
ARG ISTIO_HUB=docker.io/istio

FROM rust:1-bookworm AS build
# cmake for pingora's zlib-ng; nginx, h2load, openssl and curl for the profile-guided build's
# training load (on this stage's loopback); llvm-tools for llvm-profdata.
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake nginx nghttp2-client openssl curl \
    && rm -rf /var/lib/apt/lists/* \
    && rustup component add llvm-tools
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY benches ./benches
COPY gateway-examples ./gateway-examples
COPY scripts/pgo-build.sh scripts/rig.sh ./scripts/
# The `dist` build, profile-guided: built instrumented, trained on loopback load (HTTP/1.1,
# h2c, TLS, istiod's gateway chain), built again with the profile (about 15 minutes on 2 cores).
RUN bash scripts/pgo-build.sh

# Istio's proxyv2 with Portico as its proxy: the same Istio version as the control plane.
FROM ${ISTIO_HUB}/proxyv2:${ISTIO_VERSION} AS proxyv2
COPY --from=build --chmod=0755 /src/target/pgo/dist/portico /usr/local/bin/envoy

FROM debian:bookworm-slim AS standalone
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 1337 --home-dir /nonexistent --shell /usr/sbin/nologin portico
COPY --from=build /src/target/pgo/dist/portico /usr/local/bin/portico
COPY --from=build /src/gateway-examples /etc/portico/examples
USER 1337
# 8080: example HTTP listener; 15000: admin (/ready, /stats/prometheus, /config_dump).
EXPOSE 8080 15000
ENTRYPOINT ["/usr/local/bin/portico"]
# The demo (demo pods, control plane and gateway in one process):
#   docker run --network host IMAGE demo --config-dir /etc/portico/examples/bookinfo
# (it listens on 127.0.0.1 only, like the demo outside a container)
CMD ["-c", "/etc/portico/examples/bootstraps/bookinfo-ads.yaml"]
