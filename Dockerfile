# Multi-stage build: compile with the Rust toolchain, ship a slim non-root runtime.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY benches ./benches
COPY gateway-examples ./gateway-examples
RUN cargo build --profile dist --locked --bin portico

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 1337 --home-dir /nonexistent --shell /usr/sbin/nologin portico
COPY --from=build /src/target/dist/portico /usr/local/bin/portico
COPY --from=build /src/gateway-examples /etc/portico/examples
USER 1337
# 8080: example HTTP listener; 15000: admin (/ready, /stats/prometheus, /config_dump).
EXPOSE 8080 15000
ENTRYPOINT ["/usr/local/bin/portico"]
# The demo (demo pods, control plane and gateway in one process):
#   docker run --network host IMAGE demo --config-dir /etc/portico/examples/bookinfo
# (it listens on 127.0.0.1 only, like the demo outside a container)
CMD ["-c", "/etc/portico/examples/bootstraps/bookinfo-ads.yaml"]
