//! Fleets on the coordinator: the fleet API every coordinator serves ([`api`]) and, on the
//! leader, fleet runs: the pure machines ([`machine`]: a run; [`plan`]: a `procedure:`;
//! [`schedule`]: a trigger) and the IO around them ([`run`], [`adopt`]: runs that outlive
//! their coordinator, [`trigger`]: unattended runs), with the cost settings ([`cost`]).

pub mod adopt;
pub mod api;
pub mod cost;
pub mod machine;
pub mod plan;
pub mod run;
pub mod schedule;
pub mod trigger;
