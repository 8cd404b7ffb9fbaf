"""Engine adapters: kvbridge joining an inference engine's own disaggregation machinery as a peer."""
