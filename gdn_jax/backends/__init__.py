"""Backend-specific code: what one kind of device needs beyond XLA's forms."""
