"""diffusers' CogVideoX transformer on winsp: the text replicated, the video split over ranks (``adapter.py``)."""
