"""The models: the NaDiT DiT (dit/), the causal video VAE (vae/) and their tiny demo weights (demo)."""
