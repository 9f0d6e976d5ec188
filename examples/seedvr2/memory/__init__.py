"""Memory: the usable limit, fitting the settings to it, and the planner with its CPU twin and fake-GPU runs."""
