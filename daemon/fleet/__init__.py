"""The shared fleet adapter (issue #20, docs/fleet.md), in two parts that never import each other.

`device/`: inside `maced` (fleet.publish/rollback/status, and a federated round on local pairs).
`offdevice/`: processes that are not `maced` and that `maced` never imports: the Flower ClientApp
(run by the device's SuperNode, it talks to `maced` through the SDK), the aggregator's ServerApp,
publish signing, the deploy launcher and its command line `mace-fleet`.
"""
