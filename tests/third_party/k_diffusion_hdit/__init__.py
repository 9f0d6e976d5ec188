"""k-diffusion's hourglass diffusion transformer (HDiT, ``image_transformer_v2.py``), vendored unchanged as a test
fixture: a public model written without winsp, adopted in ``tests/test_hdit.py`` from its own code.

Origin: https://github.com/crowsonkb/k-diffusion at commit 4601bf085320592473f681a62808ed873d17fad5 (MIT license, LICENSE here): ``flags.py``,
``flops.py``, ``axial_rope.py`` from ``k_diffusion/models/`` unchanged; ``image_transformer_v2.py`` with one import
path changed; ``layers.py`` holding only ``FourierFeatures`` of ``k_diffusion/layers.py``.
"""
