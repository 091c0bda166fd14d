"""Engine plug-ins: the registry, capability rules, and the conformance certificate (toy engine)."""
