"""The login side's effects: render a job's sbatch script, prepare its run directory, hand it to a backend; studies."""
