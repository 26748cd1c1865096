"""The patch layer itself: what runs inside a vLLM worker. Imports nothing from
``camp2p_overlap.tools`` or ``camp2p_overlap.emulation``."""
