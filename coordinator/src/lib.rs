//! The coordinator: task intake and lane-ordered dispatch, fleet loops, the kill-switch.
//! Empty until the cluster issue (#7) lands.
