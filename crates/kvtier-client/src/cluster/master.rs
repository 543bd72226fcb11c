//! [`MasterLink`]: the connection to the cluster's leading master.
//!
//! It knows every master address, keeps a channel to the one that last answered as leader,
//! and retries a call on another master when the current one stops answering or says it is
//! not the leader (failover), until `retry` has passed. Errors that are the caller's (a bad
//! argument) are returned at once.

use std::future::Future;
use std::time::{Duration, Instant};

use kvtier_master::rpc::master_client::MasterClient;
use kvtier_master::rpc::ClusterRequest;
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Response, Status};

use super::ClusterError;

/// Largest RPC message accepted (a lookup of a whole batch of long keys).
const MAX_MESSAGE_BYTES: usize = 256 << 20;

pub type MasterRpc = MasterClient<Channel>;

#[derive(Debug)]
pub struct MasterLink {
    addresses: Vec<String>,
    timeout: Duration,
    retry: Duration,
    leader: Mutex<Option<(String, MasterRpc)>>,
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
    )
}

impl MasterLink {
    pub fn new(addresses: Vec<String>, timeout: Duration, retry: Duration) -> MasterLink {
        MasterLink {
            addresses,
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
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| ClusterError::Connect {
                address: address.to_string(),
                reason: e.to_string(),
            })?
            .connect_timeout(self.timeout)
            .timeout(self.timeout)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| ClusterError::Connect {
                address: address.to_string(),
                reason: e.to_string(),
            })?;
        Ok(MasterClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    /// Ask every master who leads; the first that says itself wins.
    async fn discover(&self) -> Result<(String, MasterRpc), ClusterError> {
        let mut last = String::from("no master address configured");
        for address in &self.addresses {
            match self.connect(address).await {
                Ok(mut client) => match client.cluster(ClusterRequest {}).await {
                    Ok(reply) if reply.get_ref().is_leader => {
                        return Ok((address.clone(), client));
                    }
                    Ok(reply) => {
                        last = format!(
                            "{address} is a follower (leader: {:?})",
                            reply.get_ref().leader_address
                        );
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
                        if Instant::now() >= deadline {
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
