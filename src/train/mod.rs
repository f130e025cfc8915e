//! Training: the learning-rate schedule (and, as the engine lands, the step itself).

pub mod schedule;
