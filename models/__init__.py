"""Model architectures (one file each), loaders, and the attention backends they run on."""
