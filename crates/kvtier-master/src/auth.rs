//! Authentication and admission of every master RPC.
//!
//! [`Authenticated`] wraps the tonic service: before a request reaches a handler it must carry
//! [`RPC_AUTH_HEADER`] with a fresh proof of the cluster token bound to the RPC's path
//! ([`kvtier_proto::auth`]): no header, a malformed one, a wrong MAC, a time outside the
//! window or a nonce seen within the window (a replay) is answered `UNAUTHENTICATED` without
//! running the handler. Then the request's body is read in full, within [`BODY_DEADLINE`]
//! (issue 26: a stream whose body never arrives holds no slot and ends there), and only then
//! does it take one of [`MAX_RPCS_IN_FLIGHT`] slots shared by every connection; node-liveness
//! RPCs (heartbeats, registrations) may also take one of [`RESERVED_NODE_RPCS`] kept for them,
//! so members flooding the master cannot make it drop live nodes. With no slot the call is
//! answered `RESOURCE_EXHAUSTED` at once (the client retries later) so a flood cannot queue
//! unbounded work. The token itself never crosses the wire.
//!
//! Why a wrapper rather than a tonic `Interceptor`: an interceptor does not see the request's
//! path, and the proof must be bound to it (a proof captured for `Cluster` must not authorize
//! `LeaveNode`).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvtier_proto::auth::{RpcCredential, RPC_AUTH_HEADER, RPC_NONCE_LEN};
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service};
use tonic::server::NamedService;
use tonic::Status;

// The bounds are declared in `crate::limits` (with their cross-checks).
pub use crate::limits::{
    BODY_DEADLINE, FRESHNESS_WINDOW, MAX_REMEMBERED_NONCES, MAX_RPCS_IN_FLIGHT,
    MAX_RPCS_PER_CONNECTION, MAX_RPC_MESSAGE_BYTES, RESERVED_NODE_RPCS,
};

use crate::admission::ConnInfo;
use kvtier_proto::refusals::RefusalLog;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Nonces of accepted proofs, each kept until its proof can no longer be fresh.
#[derive(Default)]
struct ReplayCache {
    seen: HashSet<[u8; RPC_NONCE_LEN]>,
    /// (forget after, unix ms; nonce), oldest first.
    order: VecDeque<(u64, [u8; RPC_NONCE_LEN])>,
}

/// Checks the proof on each RPC.
pub struct RpcAuthenticator {
    token: Vec<u8>,
    replay: Mutex<ReplayCache>,
}

impl std::fmt::Debug for RpcAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcAuthenticator").finish_non_exhaustive()
    }
}

impl RpcAuthenticator {
    pub fn new(token: Vec<u8>) -> RpcAuthenticator {
        RpcAuthenticator {
            token,
            replay: Mutex::new(ReplayCache::default()),
        }
    }

    /// Admit a call of `path` carrying `header` (the [`RPC_AUTH_HEADER`] value) at `now_ms`.
    pub fn check(&self, path: &str, header: Option<&str>, now_ms: u64) -> Result<(), Status> {
        let refuse = |why: &str| {
            metrics::counter!(AUTH_REFUSED, "reason" => why.to_string()).increment(1);
            Err(Status::unauthenticated(format!(
                "kvtier master: {why} (every RPC needs a proof of the cluster token: set \
                 KVTIER_CLUSTER_TOKEN)"
            )))
        };
        let Some(header) = header else {
            return refuse("no credential");
        };
        let Some(credential) = RpcCredential::parse(header) else {
            return refuse("malformed credential");
        };
        let window = FRESHNESS_WINDOW.as_millis() as u64;
        if credential.unix_ms.abs_diff(now_ms) > window {
            return refuse("credential outside the freshness window (clock skew?)");
        }
        // The MAC before the replay cache: an attacker without the token cannot fill it.
        if !credential.verify(&self.token, path) {
            return refuse("wrong credential");
        }
        let mut replay = self.replay.lock();
        while replay
            .order
            .front()
            .is_some_and(|(until, _)| *until < now_ms)
        {
            if let Some((_, nonce)) = replay.order.pop_front() {
                replay.seen.remove(&nonce);
            }
        }
        if replay.seen.contains(&credential.nonce) {
            return refuse("replayed credential");
        }
        if replay.seen.len() >= MAX_REMEMBERED_NONCES {
            return Err(Status::resource_exhausted(
                "kvtier master: too many fresh credentials to remember; retry",
            ));
        }
        replay.seen.insert(credential.nonce);
        replay
            .order
            .push_back((credential.unix_ms.max(now_ms) + window, credential.nonce));
        Ok(())
    }
}

/// Counter of refused RPCs, labelled `reason`.
pub const AUTH_REFUSED: &str = "kvtier_master_auth_refused_total";

/// The tonic service behind the credential check and the admission limit.
#[derive(Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Arc<RpcAuthenticator>,
    in_flight: Arc<Semaphore>,
    /// Slots only node-liveness RPCs may use ([`RESERVED_NODE_RPCS`]).
    reserved: Arc<Semaphore>,
    /// Where refused credentials are logged (rate-limited).
    refusals: Option<Arc<RefusalLog>>,
}

impl<S> Authenticated<S> {
    pub fn new(inner: S, auth: Arc<RpcAuthenticator>) -> Authenticated<S> {
        Authenticated {
            inner,
            auth,
            in_flight: Arc::new(Semaphore::new(MAX_RPCS_IN_FLIGHT)),
            reserved: Arc::new(Semaphore::new(RESERVED_NODE_RPCS)),
            refusals: None,
        }
    }

    /// Log refused credentials to `log` (one line, then one summary per interval).
    pub fn with_refusal_log(mut self, log: Arc<RefusalLog>) -> Authenticated<S> {
        self.refusals = Some(log);
        self
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

/// Whether `path` is a node-liveness RPC, which may use the reserved slots.
fn is_node_rpc(path: &str) -> bool {
    matches!(
        path.rsplit('/').next(),
        Some("Heartbeat" | "RegisterNode" | "AddNodeKeys" | "LeaveNode")
    )
}

/// The connection's RPC accounting, ended when the call's future ends or is dropped (the
/// client reset the stream).
struct InFlight(Option<ConnInfo>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(info) = &self.0 {
            info.rpc_ended();
        }
    }
}

/// Read `body` in full, within [`BODY_DEADLINE`] and the message limit (plus gRPC's 5-byte
/// frame prefix, several messages never being sent on a unary call).
async fn collect_body(mut body: tonic::body::Body) -> Result<Vec<u8>, Status> {
    use http_body_util::BodyExt;
    let limit = MAX_RPC_MESSAGE_BYTES + 5;
    let read = async {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Status::cancelled(format!("request body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if out.len() + data.len() > limit {
                    return Err(Status::out_of_range(format!(
                        "kvtier master: message length too large: request body over {limit} bytes"
                    )));
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    };
    match tokio::time::timeout(BODY_DEADLINE, read).await {
        Ok(result) => result,
        Err(_) => {
            metrics::counter!(AUTH_REFUSED, "reason" => "body deadline").increment(1);
            Err(Status::deadline_exceeded(format!(
                "kvtier master: the request body did not arrive within {} s",
                BODY_DEADLINE.as_secs()
            )))
        }
    }
}

impl<S, R> Service<http::Request<tonic::body::Body>> for Authenticated<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<R>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let header = request
            .headers()
            .get(RPC_AUTH_HEADER)
            .and_then(|v| v.to_str().ok());
        let path = request.uri().path().to_string();
        if let Err(status) = self.auth.check(&path, header, unix_ms()) {
            if let Some(log) = &self.refusals {
                let source = request
                    .extensions()
                    .get::<ConnInfo>()
                    .and_then(|c| c.remote)
                    .map_or_else(|| "?".to_string(), |a| a.ip().to_string());
                let reason = status.message().split(" (").next().unwrap_or("refused");
                log.record(reason, &source, &path);
            }
            return Box::pin(async move { Ok(status.into_http()) });
        }
        // A proven credential: the connection is a member's from now on, and busy while this
        // call runs (its idle deadline does not run).
        let conn = request.extensions().get::<ConnInfo>().cloned();
        if let Some(c) = &conn {
            c.rpc_started();
        }
        let in_flight = InFlight(conn);
        // The ready service goes with this call; a clone stays for the next (tower's rule).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.in_flight);
        let reserved = Arc::clone(&self.reserved);
        Box::pin(async move {
            let _in_flight = in_flight;
            // Issue 26: the slot is taken only once the request is complete, so streams whose
            // bodies never arrive hold nothing (they end at the body deadline).
            let (parts, body) = request.into_parts();
            let body = match collect_body(body).await {
                Ok(b) => b,
                Err(status) => return Ok(status.into_http()),
            };
            let permit = match shared.try_acquire_owned() {
                Ok(p) => p,
                Err(_) => match is_node_rpc(&path)
                    .then(|| reserved.try_acquire_owned().ok())
                    .flatten()
                {
                    Some(p) => p,
                    None => {
                        metrics::counter!(AUTH_REFUSED, "reason" => "busy").increment(1);
                        let status = Status::resource_exhausted(format!(
                            "kvtier master: {MAX_RPCS_IN_FLIGHT} RPCs in flight; retry"
                        ));
                        return Ok(status.into_http());
                    }
                },
            };
            let body = tonic::body::Body::new(http_body_util::Full::new(
                tonic::codegen::Bytes::from(body),
            ));
            let reply = inner.call(http::Request::from_parts(parts, body)).await;
            drop(permit);
            reply
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::auth::rpc_credential;

    const PATH: &str = "/kvtier.master.v1.Master/Heartbeat";

    #[test]
    fn refuses_missing_wrong_stale_replayed_and_misrouted_proofs() {
        let auth = RpcAuthenticator::new(b"token".to_vec());
        let now = 1_000_000_000;
        let good = rpc_credential(b"token", PATH, now, &[1; RPC_NONCE_LEN]);
        assert!(auth.check(PATH, None, now).is_err());
        assert!(auth.check(PATH, Some("garbage"), now).is_err());
        let wrong = rpc_credential(b"other", PATH, now, &[2; RPC_NONCE_LEN]);
        assert!(auth.check(PATH, Some(&wrong), now).is_err());
        let stale = rpc_credential(b"token", PATH, now - 31_000, &[3; RPC_NONCE_LEN]);
        assert!(auth.check(PATH, Some(&stale), now).is_err());
        assert!(auth
            .check("/kvtier.master.v1.Master/LeaveNode", Some(&good), now)
            .is_err());
        assert!(auth.check(PATH, Some(&good), now).is_ok());
        let replay = auth.check(PATH, Some(&good), now + 10).unwrap_err();
        assert_eq!(replay.code(), tonic::Code::Unauthenticated);
        assert!(replay.message().contains("replayed"));
        // Forgotten only once the proof can no longer be fresh.
        let later = rpc_credential(b"token", PATH, now + 70_000, &[1; RPC_NONCE_LEN]);
        assert!(auth.check(PATH, Some(&later), now + 70_000).is_ok());
        assert_eq!(auth.replay.lock().seen.len(), 1);
    }
}
