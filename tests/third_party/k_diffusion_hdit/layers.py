# Vendored from k-diffusion (https://github.com/crowsonkb/k-diffusion, k_diffusion/layers.py), MIT license (LICENSE in
# this folder): only the class image_transformer_v2.py uses, unchanged (the rest of layers.py needs dctorch).
import math

import torch
from torch import nn


# Embeddings

class FourierFeatures(nn.Module):
    def __init__(self, in_features, out_features, std=1.):
        super().__init__()
        assert out_features % 2 == 0
        self.register_buffer('weight', torch.randn([out_features // 2, in_features]) * std)

    def forward(self, input):
        f = 2 * math.pi * input @ self.weight.T
        return torch.cat([f.cos(), f.sin()], dim=-1)
