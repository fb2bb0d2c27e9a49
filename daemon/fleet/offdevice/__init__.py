"""The fleet's Flower processes, never part of `maced`: `client_app` (the device's ClientApp, a
client of `maced` through the SDK), `server_app` (the aggregator), `signing` (its Ed25519
signature on publishes), `deploy` (SuperLink/SuperNode launch, TLS and keys), `cli` (`mace-fleet`).
"""
