"""The tiers: where a layer's weights and optimizer state live between uses (device, host memory, files)."""
