//! The xDS side: the accepted-resource store and the ADS and SDS clients that feed it.

pub mod client;
pub mod commit;
pub mod grpc;
pub mod sds;
pub mod sources;
pub mod store;
pub mod types;
