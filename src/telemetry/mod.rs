//! What the gateway tells about the traffic it carried: the per-request record every observer
//! reads ([`StreamInfo`], Envoy's stream info with its response flags and details), and the
//! observers themselves (access logs, Istio's metrics, traces, gRPC stats).
//!
//! Layering: like `filters`, a leaf below the snapshot. The snapshot holds each observer's
//! translated config; the request path fills a `StreamInfo` as it goes and hands it over
//! once the request (or TCP connection) is over. Nothing here blocks the request path: sinks
//! that do I/O (log files, span exporters) take records over a channel and write them on a
//! task of their own.

/// An enum whose variants are also listed, in declaration order, as `Self::ALL`, so the two
/// cannot drift apart.
macro_rules! listed_enum {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $v:ident),* $(,)? }) => {
        $(#[$m])* $vis enum $name { $($(#[$vm])* $v),* }
        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: [$name; [$(stringify!($v)),*].len()] = [$($name::$v),*];
        }
    };
}

pub mod access_log;
pub mod istio_stats;
pub mod stream_info;
pub mod trace;

pub use stream_info::{Protocol, ResponseFlag, ResponseFlags, StreamInfo, UpstreamInfo};
