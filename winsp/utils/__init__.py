"""Small helpers every layer may use: argument checks and the planning-phase marker for torch.compile."""
