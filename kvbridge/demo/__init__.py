"""``kvbridge demo``: a tour of the library on synthetic data, every step checked."""
