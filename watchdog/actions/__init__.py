"""What is done about a verdict: atomic checkpoints, ranks agreeing on one action, and the
supervisor that restarts a job which exited 42."""
