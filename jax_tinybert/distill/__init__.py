"""What distillation computes: student -> teacher layer maps, loss terms, named objectives."""
