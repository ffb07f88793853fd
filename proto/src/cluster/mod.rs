//! The cluster's names and records: every JetStream resource and subject the coordinator
//! and workers share, the task record kept in `mur_tasks`, the NATS API's requests,
//! replies and wire error, and the validation of a submitted task.
//!
//! Names follow the design, §JetStream resources, with one change the code taught: there is
//! no `MUR_TASKS` stream. The coordinator keeps waiting tasks in lanes of its own
//! (the design, §JetStream resources, shape (a)), rebuilt at start from `mur_tasks`, and
//! releases one task at a time into the `MUR_DISPATCH` work queue when a worker slot is
//! free.
//!
//! Pure: no async-nats, no IO, no clock (callers pass unix milliseconds in).
//!
//! One file per concern, each re-exported here (paths stay `cluster::…`): `names`
//! (resources, subjects, [`api`]), `record` (the task record, the dispatch), `requests`
//! (the API's requests, replies, errors), `sessions` (checkpoints, conversations),
//! `journal` (the tool-call journal and its replay at a takeover), `status`, `workers`,
//! `capsules`, `tokens` (A2A bearer tokens: their record and grants).

use crate::fanout::FleetStep;
use crate::manifest::is_valid_name;
use crate::task::{ExitStatus, Lane, Origin, TaskState};
use crate::{Id, IdKind, TaskId};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;

mod capsules;
mod journal;
mod names;
mod record;
mod requests;
mod sessions;
mod status;
mod tokens;
mod workers;

pub use capsules::*;
pub use journal::*;
pub use names::*;
pub use record::*;
pub use requests::*;
pub use sessions::*;
pub use status::*;
pub use tokens::*;
pub use workers::*;
