"""DFlash speculative decoding. It plugs into the engine at two points, both called from above:
the model runner verifies a step's drafts through `verify.Verifier` (inputs before the target
forward, rejection sampling after it), and the engine queues the next drafts through
`draft_launch.DraftLauncher` before the step's readback. The proposer runs the drafter, eagerly
or from its own CUDA graphs; nothing here imports the engine."""
