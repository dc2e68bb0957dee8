"""The extraction job: config, resource plan, actors, replica pool and the driver that runs them."""
