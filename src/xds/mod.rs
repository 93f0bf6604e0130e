//! The xDS side: the accepted-resource store and the ADS client that feeds it.

pub mod client;
pub mod store;
pub mod types;
