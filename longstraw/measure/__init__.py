"""Instrumentation (no model code): per-phase memory and time (`memory`), the capture attention
rate (`timing`), FLOP counts (`flops`), progress bars (`progress`), provenance (`provenance`)."""
