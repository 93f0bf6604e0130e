//! The few OpenTelemetry protocol messages a span export needs
//! (`opentelemetry/proto/collector/trace/v1/trace_service.proto` and what it uses), written
//! by hand: no crate of them matches prost 0.14. Field numbers are the protos'.

/// `opentelemetry.proto.collector.trace.v1.TraceService/Export`.
pub const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportTraceServiceResponse {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ScopeSpans {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Span {
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    #[prost(string, tag = "3")]
    pub trace_state: String,
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    /// SPAN_KIND_SERVER = 2, SPAN_KIND_CLIENT = 3.
    #[prost(int32, tag = "6")]
    pub kind: i32,
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
    #[prost(message, optional, tag = "15")]
    pub status: Option<Status>,
}

pub const SPAN_KIND_SERVER: i32 = 2;
pub const SPAN_KIND_CLIENT: i32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    #[prost(string, tag = "2")]
    pub message: String,
    /// STATUS_CODE_UNSET = 0, OK = 1, ERROR = 2.
    #[prost(int32, tag = "3")]
    pub code: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyValue {
    #[prost(oneof = "any_value::Value", tags = "1, 2, 3")]
    pub value: Option<any_value::Value>,
}

pub mod any_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(string, tag = "1")]
        StringValue(String),
        #[prost(bool, tag = "2")]
        BoolValue(bool),
        #[prost(int64, tag = "3")]
        IntValue(i64),
    }
}

impl KeyValue {
    pub fn string(key: impl Into<String>, value: impl Into<String>) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(value.into())),
            }),
        }
    }

    /// The value if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self.value.as_ref()?.value.as_ref()? {
            any_value::Value::StringValue(s) => Some(s),
            _ => None,
        }
    }
}

/// Zipkin's `zipkin.proto3` messages, for `HTTP_PROTO` collectors.
pub mod zipkin {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ListOfSpans {
        #[prost(message, repeated, tag = "1")]
        pub spans: Vec<Span>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Span {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub parent_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "3")]
        pub id: Vec<u8>,
        /// CLIENT = 1, SERVER = 2.
        #[prost(int32, tag = "4")]
        pub kind: i32,
        #[prost(string, tag = "5")]
        pub name: String,
        #[prost(fixed64, tag = "6")]
        pub timestamp: u64,
        #[prost(uint64, tag = "7")]
        pub duration: u64,
        #[prost(message, optional, tag = "8")]
        pub local_endpoint: Option<Endpoint>,
        #[prost(message, repeated, tag = "10")]
        pub annotations: Vec<Annotation>,
        #[prost(map = "string, string", tag = "11")]
        pub tags: std::collections::HashMap<String, String>,
        #[prost(bool, tag = "13")]
        pub shared: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Endpoint {
        #[prost(string, tag = "1")]
        pub service_name: String,
        #[prost(bytes = "vec", tag = "2")]
        pub ipv4: Vec<u8>,
        #[prost(bytes = "vec", tag = "3")]
        pub ipv6: Vec<u8>,
        #[prost(int32, tag = "4")]
        pub port: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Annotation {
        #[prost(fixed64, tag = "1")]
        pub timestamp: u64,
        #[prost(string, tag = "2")]
        pub value: String,
    }
}
