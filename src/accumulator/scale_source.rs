//! What a store unscales a micro-batch by, handed to it by the accumulator at each add: the
//! scaler's scale when it is on the host, else its state in device memory, which the store's
//! kernels read and into which the scaler gathers a synced boundary's overflow flag. Stores see
//! this and never the scaler, so no store depends on how a device keeps a scaler's state.

use crate::device::{DevicePtr, Stream};
use crate::error::{Error, ErrorKind, Result};

/// Where an add finds the loss scale.
#[derive(Clone, Copy)]
pub(crate) enum ScaleSource<'a> {
    /// A host scaler's current scale.
    Host(f32),
    /// A scaler whose state lives in device memory.
    Device(&'a dyn DeviceScale),
}

impl<'a> ScaleSource<'a> {
    /// The scale, for a store that unscales on the host.
    pub(crate) fn host(self) -> Result<f32> {
        match self {
            ScaleSource::Host(scale) => Ok(scale),
            ScaleSource::Device(_) => Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the scaler is on a CUDA device: this call needs a CPU scaler",
            )),
        }
    }

    /// The device state, for a store whose kernels read it.
    pub(crate) fn device(self) -> Result<&'a dyn DeviceScale> {
        match self {
            ScaleSource::Device(state) => Ok(state),
            ScaleSource::Host(_) => Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the scaler is on the CPU, not on a CUDA device",
            )),
        }
    }
}

/// A scaler's state in device memory, ordered on the scaler's stream. Kernels on other streams
/// read it through [`DeviceScale::read_on`], so that no update, load or free of the state
/// overtakes a read that another stream has queued, nor a read a pending write.
pub(crate) trait DeviceScale: Send + Sync {
    /// The scaler's stream: its gathers and updates run there.
    fn stream(&self) -> Stream;

    /// Enqueues `launch` (given the state's device address) on `stream`: a kernel that reads the
    /// state, after the scaler's pending writes and before its next write or free.
    fn read_on(
        &self,
        stream: Stream,
        launch: &mut dyn FnMut(DevicePtr) -> Result<()>,
    ) -> Result<()>;

    /// Enqueues the gather of the overflow flag of the synced boundary at `boundary`, which the
    /// caller has ordered before the scaler's stream (and orders its next write after).
    fn gather_ordered(&self, boundary: DevicePtr) -> Result<()>;

    /// Forgets the flags gathered since the last update (a step that failed halfway through its
    /// gathers must not leave some of them to the next update).
    fn clear_gathered(&self) -> Result<()>;

    /// Enqueues one optimizer step's update from the gathered flags. With `read`, waits for it
    /// and returns whether the step was skipped.
    fn update(&self, read: bool) -> Result<Option<bool>>;
}

impl dyn DeviceScale + '_ {
    /// [`DeviceScale::read_on`] with the launch as a closure.
    pub(crate) fn launch_reading(
        &self,
        stream: Stream,
        mut launch: impl FnMut(DevicePtr) -> Result<()>,
    ) -> Result<()> {
        self.read_on(stream, &mut launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device state at a fixed address that records the stream of each read.
    struct Recorder {
        reads: std::sync::Mutex<Vec<usize>>,
    }

    const STATE: DevicePtr = 0x7f00_0000;

    impl DeviceScale for Recorder {
        fn stream(&self) -> Stream {
            std::ptr::null_mut()
        }

        fn read_on(
            &self,
            stream: Stream,
            launch: &mut dyn FnMut(DevicePtr) -> Result<()>,
        ) -> Result<()> {
            self.reads.lock().unwrap().push(stream as usize);
            launch(STATE)
        }

        fn gather_ordered(&self, _boundary: DevicePtr) -> Result<()> {
            Ok(())
        }

        fn clear_gathered(&self) -> Result<()> {
            Ok(())
        }

        fn update(&self, _read: bool) -> Result<Option<bool>> {
            Ok(None)
        }
    }

    #[test]
    fn a_store_gets_the_source_of_its_memory_or_a_device_mismatch() {
        let device = Recorder { reads: Default::default() };
        assert_eq!(ScaleSource::Host(1024.0).host().unwrap(), 1024.0);
        assert!(ScaleSource::Device(&device).device().is_ok());
        let e = ScaleSource::Device(&device).host().unwrap_err();
        assert_eq!(e.kind, ErrorKind::DeviceMismatch);
        let e = ScaleSource::Host(1024.0).device().err().expect("a host scale has no device state");
        assert_eq!(e.kind, ErrorKind::DeviceMismatch);
    }

    #[test]
    fn a_launch_reads_the_state_on_the_readers_stream_and_its_error_returns() {
        let device = Recorder { reads: Default::default() };
        let state: &dyn DeviceScale = &device;
        let reader = 0x40 as Stream;
        let mut seen = None;
        state
            .launch_reading(reader, |address| {
                seen = Some(address);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, Some(STATE));
        let e = state
            .launch_reading(reader, |_| Err(Error::new(ErrorKind::DeviceFailure, "launch")))
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::DeviceFailure);
        assert_eq!(*device.reads.lock().unwrap(), [0x40, 0x40]);
    }
}
