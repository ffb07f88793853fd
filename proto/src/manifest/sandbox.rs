//! The manifest's `sandbox:` block (issue #37): what a capsule's commands (shell commands,
//! command tools, hooks) may read, write and connect to, and their memory, process and CPU
//! limits. This module checks the block's shape and values; whether the kernel can enforce
//! it is the worker's question, asked before any command runs (`worker/src/sandbox`).

use super::{Int, Rules};
use serde::Deserialize;
use std::fmt;

/// A validated `sandbox:` block. An absent block runs commands unconfined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    /// Paths readable (and executable) besides the system's programs and libraries, the
    /// folder commands run in and the session folder, as written: absolute, `~/…` (the
    /// capsule home, `<folder commands run in>/.capsule-home`) or relative (to the folder
    /// commands run in).
    pub read: Vec<String>,
    /// Paths writable (and readable) besides the folder commands run in and the session
    /// folder; written as `read`.
    pub write: Vec<String>,
    /// Where commands may connect; default [`Network::None`].
    pub network: Network,
    /// The memory of all the processes of one command together, MiB; `None`: no limit.
    pub memory_mb: Option<u64>,
    /// How many processes (threads count) one command may have at once; `None`: no limit.
    pub pids: Option<u32>,
    /// CPU seconds each process of a command may use; `None`: no limit.
    pub cpu_secs: Option<u64>,
}

/// `sandbox.network`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Network {
    /// No network at all (default).
    None,
    /// Connections to the machine's loopback addresses only.
    Loopback,
    /// TCP connections to these endpoints only.
    Allow(Vec<Endpoint>),
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Network::None => f.write_str("none"),
            Network::Loopback => f.write_str("loopback"),
            Network::Allow(list) => {
                let items: Vec<String> = list.iter().map(Endpoint::to_string).collect();
                write!(f, "[{}]", items.join(", "))
            }
        }
    }
}

/// One `host:port` of a `sandbox.network` list. `host` is `*` (any host), an IPv4
/// address, a bracketed IPv6 address (`[::1]`) or a name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The host as written, brackets of an IPv6 address removed; `*` for any host.
    pub host: String,
    /// The TCP port, 1–65535.
    pub port: u16,
}

impl Endpoint {
    /// Whether the entry allows the port on every host (`*:PORT`).
    pub fn any_host(&self) -> bool {
        self.host == "*"
    }

    /// Parses `host:port`.
    ///
    /// # Errors
    /// The rule broken, naming the entry.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        let rule = || format!("must be host:port (*:443, 127.0.0.1:8080, [::1]:80, api.example.com:443), got {text:?}");
        let (host, port) = text.rsplit_once(':').ok_or_else(rule)?;
        let host = match host.strip_prefix('[') {
            Some(v6) => v6.strip_suffix(']').filter(|h| h.parse::<std::net::Ipv6Addr>().is_ok()).ok_or_else(rule)?,
            None if host.contains(':') => return Err(rule()),
            None => host,
        };
        let host_ok = host == "*"
            || (!host.is_empty()
                && host.len() <= 253
                && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':')));
        if !host_ok {
            return Err(rule());
        }
        match port.parse::<u16>() {
            Ok(port) if port > 0 => Ok(Endpoint { host: host.to_string(), port }),
            _ => Err(format!("the port must be 1-65535, got {port:?} in {text:?}")),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// The block as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a mapping")]
pub(super) struct RawSandbox {
    read: Option<Vec<String>>,
    write: Option<Vec<String>>,
    network: Option<RawNetwork>,
    memory_mb: Option<Int>,
    pids: Option<Int>,
    cpu_secs: Option<Int>,
}

/// Reads a key that is present, its value possibly null (`sandbox:` alone).
pub(super) fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<RawSandbox>>, D::Error> {
    Option::<RawSandbox>::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "none, loopback or a list of host:port")]
enum RawNetwork {
    Word(String),
    List(Vec<String>),
}

/// Checks the block: paths non-empty without NUL, `network` one of its forms, limits at
/// least 1 (memory at least 1 MiB, pids at most 4194304, the kernel's own ceiling).
pub(super) fn validate(raw: RawSandbox, r: &mut Rules) -> Sandbox {
    let mut paths = |key: &str, list: Option<Vec<String>>| {
        let list = list.unwrap_or_default();
        for (i, p) in list.iter().enumerate() {
            if p.is_empty() || p.contains('\0') {
                r.fail(&format!("sandbox.{key}[{i}]"), format_args!("must be a path, got {p:?}"));
            } else if p.starts_with('~') && p != "~" && !p.starts_with("~/") {
                r.fail(
                    &format!("sandbox.{key}[{i}]"),
                    format_args!("~ stands for the capsule home alone (~/dir), got {p:?}"),
                );
            }
        }
        list
    };
    let read = paths("read", raw.read);
    let write = paths("write", raw.write);
    let network = match raw.network {
        None => Network::None,
        Some(RawNetwork::Word(w)) => match w.as_str() {
            "none" => Network::None,
            "loopback" => Network::Loopback,
            other => {
                r.fail("sandbox.network", format_args!("must be none, loopback or a list of host:port, got {other:?}"));
                Network::None
            }
        },
        Some(RawNetwork::List(list)) => {
            let mut endpoints = Vec::with_capacity(list.len());
            for (i, text) in list.iter().enumerate() {
                match Endpoint::parse(text) {
                    Ok(e) => endpoints.push(e),
                    Err(rule) => r.fail(&format!("sandbox.network[{i}]"), rule),
                }
            }
            Network::Allow(endpoints)
        }
    };
    Sandbox {
        read,
        write,
        network,
        memory_mb: raw.memory_mb.map(|v| r.int("sandbox.memory_mb", Some(v), 1, 1) as u64),
        pids: raw.pids.map(|v| r.bounded("sandbox.pids", Some(v), 1, 4_194_304, 1)),
        cpu_secs: raw.cpu_secs.map(|v| r.int("sandbox.cpu_secs", Some(v), 1, 1) as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_hosts_and_ports() {
        let e = Endpoint::parse("127.0.0.1:8080").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 8080));
        let e = Endpoint::parse("[::1]:80").unwrap();
        assert_eq!((e.host.as_str(), e.port, e.to_string()), ("::1", 80, "[::1]:80".to_string()));
        assert!(Endpoint::parse("*:443").unwrap().any_host());
        assert_eq!(Endpoint::parse("api.example.com:443").unwrap().host, "api.example.com");
        assert_eq!(Endpoint::parse("x:0").unwrap_err(), "the port must be 1-65535, got \"0\" in \"x:0\"");
        assert!(Endpoint::parse("x:65536").is_err());
        assert!(Endpoint::parse("8080").is_err());
        assert!(Endpoint::parse("::1:80").is_err());
        assert!(Endpoint::parse("a b:80").is_err());
        assert!(Endpoint::parse(":80").is_err());
    }
}
