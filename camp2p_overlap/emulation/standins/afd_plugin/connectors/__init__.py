"""Stand-in package (see camp2p_overlap.emulation.standins)."""
