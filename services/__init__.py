"""Meridian's services, one package each: rollout, trainer, weightsync, envsandbox."""
