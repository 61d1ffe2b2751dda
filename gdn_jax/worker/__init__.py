"""The worker: executes one step plan on the device (memory plan, step programs, compilation, executable store)."""
