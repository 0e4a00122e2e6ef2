"""`megatron-dapo simulate`: the coordinator's own code on virtual time against cost-model engines and a
simulated trainer."""
