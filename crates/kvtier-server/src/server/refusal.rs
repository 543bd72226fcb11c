//! A request refused as a whole (answered with an `ErrorReply`): what sessions and
//! connections both return, in a module of its own so neither imports the other for it.

use kvtier_proto::server::error_code;
use kvtier_proto::ProtoError;

/// A request failed as a whole: answered with an `ErrorReply` carrying `code` and `message`.
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) code: u16,
    pub(super) message: String,
}

impl Refusal {
    pub(super) fn new(code: u16, message: impl Into<String>) -> Self {
        Refusal {
            code,
            message: message.into(),
        }
    }
}

impl From<ProtoError> for Refusal {
    fn from(e: ProtoError) -> Self {
        Refusal::new(error_code::MALFORMED, e.to_string())
    }
}
