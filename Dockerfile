# Ambit: one image for every role (agent, proxy, node, cni, control-plane).
#
#   podman build -t ambit .          (or docker build)
#   podman build --build-arg FEATURES=fips -t ambit:fips .
#                                    the FIPS flavour: every TLS and key
#                                    operation on aws-lc's FIPS 140-3 module
#                                    (building it needs CMake and Go)
#
# Both stages take their base as a build argument so the image can be built
# where no registry is reachable (the tests build it on a local Debian base;
# see .ci/install-deps).
ARG BUILD_IMAGE=docker.io/library/rust:1-bookworm
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
ARG FEATURES=
# The FIPS module's build needs CMake and Go; the default build needs neither.
RUN if [ "$FEATURES" = fips ] && ! { command -v cmake && command -v go; } >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends cmake golang-go \
      && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY benches benches
COPY link link
# glibc linked statically: the same binary is installed on the host as the
# CNI plugin, whose glibc may be older than the image's.
RUN target="$(uname -m)-unknown-linux-gnu" \
 && RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --locked --bin ambit --target "$target" ${FEATURES:+--features "$FEATURES"} \
 && install -m 0755 "target/$target/release/ambit" /ambit

FROM ${BASE_IMAGE}
# iptables (nft and legacy back ends), nftables, iproute2 and ipset are what
# the agent programs pods and the host with.
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables iproute2 ipset ca-certificates \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
COPY --from=build /ambit /usr/local/bin/ambit
RUN for role in agent proxy node cni control-plane; do ln -s ambit "/usr/local/bin/ambit-$role"; done \
 && /usr/local/bin/ambit version
ENTRYPOINT ["/usr/local/bin/ambit"]
CMD ["node"]
