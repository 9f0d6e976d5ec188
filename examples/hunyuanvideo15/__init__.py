"""diffusers' HunyuanVideo 1.5 with sliding tile attention on winsp: the user's single-device STA processor
(``sta.py``), the plan (``adapter.py``) and the 720p x 121-frame layer's figures (``figures.py``)."""
