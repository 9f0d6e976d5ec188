"""A small video transformer written with NATTEN's functional API, and the one plan that runs it on winsp."""
