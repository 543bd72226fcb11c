//! [`MasterLink`]: the connection to the cluster's leading master.
//!
//! It knows every master address, keeps a channel to the one that last answered as leader,
//! and retries a call on another master when the current one stops answering or says it is
//! not the leader (failover), until `retry` has passed. Errors that are the caller's (a bad
//! argument, a refused credential) are returned at once.
//!
//! Every call carries a fresh proof of the cluster token bound to the RPC's path
//! ([`MasterCredential`], checked by the master's `auth` module); the token itself is never
//! sent.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvtier_proto::auth::{rpc_credential, RPC_AUTH_HEADER, RPC_NONCE_LEN};
use kvtier_rpc::master_client::MasterClient;
use kvtier_rpc::ClusterRequest;
use parking_lot::Mutex;
use tonic::codegen::{GrpcMethod, InterceptedService};
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};

use crate::TransportError;

/// Largest RPC message sent or accepted: the master's own limit, so an oversized request fails
/// here with a clear error.
const MAX_MESSAGE_BYTES: usize = kvtier_rpc::MAX_RPC_MESSAGE_BYTES;

pub type MasterRpc = MasterClient<InterceptedService<Channel, MasterCredential>>;

/// Adds the [`RPC_AUTH_HEADER`] proof to every request of a [`MasterRpc`].
#[derive(Clone)]
pub struct MasterCredential {
    token: Arc<Vec<u8>>,
}

impl std::fmt::Debug for MasterCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterCredential").finish_non_exhaustive()
    }
}

impl MasterCredential {
    pub fn new(token: Vec<u8>) -> MasterCredential {
        MasterCredential {
            token: Arc::new(token),
        }
    }
}

impl Interceptor for MasterCredential {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        // The generated client names the method of every call.
        let path = request
            .extensions()
            .get::<GrpcMethod>()
            .map(|m| format!("/{}/{}", m.service(), m.method()))
            .ok_or_else(|| Status::internal("kvtier: an RPC without its method name"))?;
        let nonce = kvtier_proto::auth::nonce::<RPC_NONCE_LEN>()
            .map_err(|e| Status::internal(format!("kvtier: no random bytes: {e}")))?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let value = MetadataValue::try_from(rpc_credential(&self.token, &path, now, &nonce))
            .map_err(|_| Status::internal("kvtier: credential is not a header value"))?;
        request.metadata_mut().insert(RPC_AUTH_HEADER, value);
        Ok(request)
    }
}

/// An authenticated client of the master at `address` (host:port), with `timeout` on connect
/// and on each call.
pub async fn connect(
    address: &str,
    credential: MasterCredential,
    timeout: Duration,
) -> Result<MasterRpc, ClusterError> {
    let endpoint = Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| ClusterError::Connect {
            address: address.to_string(),
            reason: e.to_string(),
        })?
        .connect_timeout(timeout)
        .timeout(timeout)
        .tcp_nodelay(true);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| ClusterError::Connect {
            address: address.to_string(),
            reason: error_chain(&e),
        })?;
    Ok(MasterClient::with_interceptor(channel, credential)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

#[derive(Debug)]
pub struct MasterLink {
    addresses: Vec<String>,
    credential: MasterCredential,
    timeout: Duration,
    retry: Duration,
    leader: Mutex<Option<(String, MasterRpc)>>,
}

/// Issue 27: the master refused the caller's proof of the cluster token.
pub fn credential_refused(code: Code) -> bool {
    matches!(code, Code::Unauthenticated | Code::PermissionDenied)
}

/// An error and its sources, `a: b: c` (tonic's "transport error" alone does not say whether
/// the name did not resolve or the connection was refused).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::FailedPrecondition
            | Code::Unavailable
            | Code::Unknown
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Aborted
            | Code::ResourceExhausted
    )
}

impl MasterLink {
    /// A link to the masters at `addresses` proving `token` on every call.
    pub fn new(
        addresses: Vec<String>,
        token: Vec<u8>,
        timeout: Duration,
        retry: Duration,
    ) -> MasterLink {
        MasterLink {
            addresses,
            credential: MasterCredential::new(token),
            timeout,
            retry,
            leader: Mutex::new(None),
        }
    }

    /// The address of the master that last answered as leader.
    pub fn current_leader(&self) -> Option<String> {
        self.leader.lock().as_ref().map(|(a, _)| a.clone())
    }

    async fn connect(&self, address: &str) -> Result<MasterRpc, ClusterError> {
        connect(address, self.credential.clone(), self.timeout).await
    }

    /// Ask every master who leads; the first that says itself wins.
    async fn discover(&self) -> Result<(String, MasterRpc), ClusterError> {
        let mut last = String::from("no master address configured");
        for address in &self.addresses {
            match self.connect(address).await {
                Ok(mut client) => match client.cluster(ClusterRequest::default()).await {
                    Ok(reply) if reply.get_ref().is_leader => {
                        return Ok((address.clone(), client));
                    }
                    Ok(reply) => {
                        last = format!(
                            "{address} is a follower (leader: {:?})",
                            reply.get_ref().leader_address
                        );
                    }
                    // Issue 27: a refused credential is final, not a reason to try on.
                    Err(status) if credential_refused(status.code()) => {
                        return Err(ClusterError::Rpc {
                            address: address.clone(),
                            code: status.code(),
                            message: status.message().to_string(),
                        });
                    }
                    Err(status) => last = format!("{address}: {}", status.message()),
                },
                Err(e) => last = e.to_string(),
            }
        }
        Err(ClusterError::NoLeader { last })
    }

    /// Run `call` against the leader, following failovers for up to `retry`.
    pub async fn call<T, F, Fut>(&self, call: F) -> Result<T, ClusterError>
    where
        F: Fn(MasterRpc) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.retry;
        loop {
            let cached = self.leader.lock().clone();
            let (address, client) = match cached {
                Some(c) => c,
                None => match self.discover().await {
                    Ok(found) => {
                        *self.leader.lock() = Some(found.clone());
                        found
                    }
                    Err(e) => {
                        if Instant::now() >= deadline || e.is_credential_refused() {
                            return Err(e);
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            match call(client).await {
                Ok(reply) => return Ok(reply.into_inner()),
                Err(status) if retryable(&status) => {
                    {
                        let mut leader = self.leader.lock();
                        if leader.as_ref().is_some_and(|(a, _)| *a == address) {
                            *leader = None;
                        }
                    }
                    if Instant::now() >= deadline {
                        return Err(ClusterError::Rpc {
                            address,
                            code: status.code(),
                            message: status.message().to_string(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(status) => {
                    return Err(ClusterError::Rpc {
                        address,
                        code: status.code(),
                        message: status.message().to_string(),
                    })
                }
            }
        }
    }
}

/// Errors of the cluster control path.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("kvtier master {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("no kvtier master answered as leader ({last})")]
    NoLeader { last: String },
    #[error("kvtier master {address}: {code:?}: {message}")]
    Rpc {
        address: String,
        code: tonic::Code,
        message: String,
    },
    #[error("cluster mode: {0}")]
    Setup(String),
    #[error("kvtier master sent a malformed reply: {0}")]
    BadReply(String),
    #[error("cluster node {node}: {source}")]
    Node {
        node: String,
        #[source]
        source: TransportError,
    },
}

impl ClusterError {
    /// Issue 29: a fault of the cluster (a master unreachable, no leader, a node down, a
    /// timeout, a malformed reply), not of the caller's setup or credential.
    pub fn is_infrastructure(&self) -> bool {
        match self {
            ClusterError::Setup(_) => false,
            ClusterError::Rpc { code, .. } => !matches!(
                code,
                tonic::Code::InvalidArgument
                    | tonic::Code::OutOfRange
                    | tonic::Code::Unauthenticated
                    | tonic::Code::PermissionDenied
            ),
            ClusterError::Connect { .. }
            | ClusterError::NoLeader { .. }
            | ClusterError::BadReply(_)
            | ClusterError::Node { .. } => true,
        }
    }

    /// Issue 27: the master refused the cluster token (Unauthenticated / PermissionDenied):
    /// retrying cannot help.
    pub fn is_credential_refused(&self) -> bool {
        matches!(self, ClusterError::Rpc { code, .. } if credential_refused(*code))
    }
}
