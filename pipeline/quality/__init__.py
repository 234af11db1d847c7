"""Quality of an output: its statistics and the drift gate, the drift page, and the run report."""
