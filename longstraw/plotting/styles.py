"""Each mode's colour in every figure (`draw` re-exports it). Ours are written here; a peer's is added when it is
registered (`longstraw.peers.register_peer`), since the peers sit above plotting. No matplotlib: the registry
imports this."""

MODE_COLORS = {
    "replay": "#dd8452",
    "hold_all": "#4c72b0",
    "naive": "#c44e52",
}
