//! A mesh's shape for frameworks without their own parallel state: from the world's size and the
//! axis sizes, each rank's coordinates and the members of each of its groups, in
//! Megatron-Core's rank order by default (tensor-parallel fastest, then context, data and
//! pipeline: `tp-cp-dp-pp`), any order on request. Experts view the same ranks of each pipeline
//! stage as expert-tensor × expert × expert-data parallel, expert-tensor fastest, as
//! Megatron-Core's expert rank generator does. A group's ranks are its members in world rank
//! order. In-process groups come from [`MeshShape::local_groups`]; MPI and NCCL ones from
//! [`MeshShape::split`] of the world.

use std::sync::Arc;

use crate::comm::{Communicator, LocalComm};
use crate::error::{Error, Result};

/// An axis of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Tensor parallel.
    Tp,
    /// Context (sequence) parallel: a data axis, its ranks see different tokens.
    Cp,
    /// Data parallel.
    Dp,
    /// Pipeline parallel, shared by the dense and the expert view.
    Pp,
    /// Expert parallel.
    Ep,
    /// Expert tensor parallel.
    Etp,
    /// Expert data parallel: the ranks that hold the same experts.
    Edp,
}

impl Axis {
    /// Its name in a rank order or an axis list: `tp`, `cp`, `dp`, `pp`, `ep`, `etp`, `edp`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Ep => "ep",
            Axis::Etp => "etp",
            Axis::Edp => "edp",
        }
    }

    /// The axes of `list`, names joined by `-` as Megatron-Core writes a rank order
    /// (`"tp-cp-dp-pp"`), each at most once.
    pub fn parse_list(list: &str) -> Result<Vec<Axis>> {
        const ALL: [Axis; 7] =
            [Axis::Tp, Axis::Cp, Axis::Dp, Axis::Pp, Axis::Ep, Axis::Etp, Axis::Edp];
        let mut axes = Vec::new();
        for name in list.split('-') {
            let axis = ALL.into_iter().find(|a| a.name() == name).ok_or_else(|| {
                Error::invalid(format!(
                    "axis list \"{list}\": \"{name}\" is none of tp, cp, dp, pp, ep, etp, edp \
                     (names joined by '-')"
                ))
            })?;
            if axes.contains(&axis) {
                return Err(Error::invalid(format!("axis list \"{list}\" names {name} twice")));
            }
            axes.push(axis);
        }
        Ok(axes)
    }
}

const DENSE: [Axis; 4] = [Axis::Tp, Axis::Cp, Axis::Dp, Axis::Pp];
const EXPERT: [Axis; 4] = [Axis::Etp, Axis::Ep, Axis::Edp, Axis::Pp];

/// The sizes and rank order of a mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshShape {
    world: usize,
    /// Sizes of [`DENSE`]'s axes.
    dense: [usize; 4],
    /// The dense axes, fastest first.
    order: [Axis; 4],
    /// Sizes of [`EXPERT`]'s axes.
    expert: [usize; 4],
}

impl MeshShape {
    /// A mesh of `world` ranks with `tp`, `pp`, `cp` ranks on those axes (data parallel takes
    /// the rest), and experts over `ep` × `etp` ranks of each stage (expert data parallel takes
    /// the rest of the stage).
    pub fn new(
        world: usize,
        tp: usize,
        pp: usize,
        cp: usize,
        ep: usize,
        etp: usize,
    ) -> Result<Self> {
        let model = tp * pp * cp;
        if [tp, pp, cp, ep, etp].contains(&0) || world == 0 || !world.is_multiple_of(model) {
            return Err(Error::invalid(format!(
                "a world of {world} ranks cannot hold tp {tp} x pp {pp} x cp {cp}: every size at \
                 least 1, their product dividing the world"
            )));
        }
        let dp = world / model;
        let stage = world / pp;
        if !stage.is_multiple_of(ep * etp) {
            return Err(Error::invalid(format!(
                "a pipeline stage of {stage} ranks cannot hold ep {ep} x etp {etp}: their \
                 product must divide it"
            )));
        }
        Ok(MeshShape {
            world,
            dense: [tp, cp, dp, pp],
            order: DENSE,
            expert: [etp, ep, stage / (ep * etp), pp],
        })
    }

    /// The same sizes with the dense axes in `order`, fastest first (a permutation of Tp, Cp,
    /// Dp and Pp).
    pub fn with_order(mut self, order: [Axis; 4]) -> Result<Self> {
        if !DENSE.iter().all(|a| order.contains(a)) {
            return Err(Error::invalid(format!(
                "rank order {order:?}: a permutation of Tp, Cp, Dp and Pp, fastest first"
            )));
        }
        self.order = order;
        Ok(self)
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// How many ranks `axis` has.
    pub fn size(&self, axis: Axis) -> usize {
        match view(axis) {
            (View::Dense, i) => self.dense[i],
            (View::Expert, i) => self.expert[i],
        }
    }

    /// `rank`'s coordinate on `axis`.
    pub fn coord(&self, rank: usize, axis: Axis) -> usize {
        match view(axis) {
            (View::Dense, i) => self.dense_coords(rank)[i],
            (View::Expert, i) => self.expert_coords(rank)[i],
        }
    }

    /// The members of `rank`'s group over `axes` (all of one view; Pp belongs to both), in
    /// world rank order: the ranks whose other coordinates are `rank`'s.
    pub fn members(&self, rank: usize, axes: &[Axis]) -> Result<Vec<usize>> {
        let view = self.view_of(axes)?;
        let coords = |r: usize| match view {
            View::Dense => self.dense_coords(r),
            View::Expert => self.expert_coords(r),
        };
        let axes_of = match view {
            View::Dense => DENSE,
            View::Expert => EXPERT,
        };
        let mine = coords(rank);
        Ok((0..self.world)
            .filter(|&r| {
                let theirs = coords(r);
                (0..4).all(|i| axes.contains(&axes_of[i]) || theirs[i] == mine[i])
            })
            .collect())
    }

    /// The group over `axes` that `rank` belongs to, as a number shared by its members (the
    /// smallest member): a split's color.
    pub fn color(&self, rank: usize, axes: &[Axis]) -> Result<usize> {
        Ok(self.members(rank, axes)?[0])
    }

    /// `rank`'s rank in its group over `axes`: its index among the members.
    pub fn key(&self, rank: usize, axes: &[Axis]) -> Result<usize> {
        let members = self.members(rank, axes)?;
        Ok(members.iter().position(|&r| r == rank).expect("a rank is its own member"))
    }

    /// This rank's group over `axes`, split from `world` (a communicator of every rank of the
    /// mesh, in world rank order: MPI or NCCL) by [`MeshShape::color`] and [`MeshShape::key`].
    /// Collective over `world`: every rank calls it with the same axes.
    pub fn split(&self, world: &dyn Communicator, axes: &[Axis]) -> Result<Arc<dyn Communicator>> {
        if world.world_size() != self.world {
            return Err(Error::invalid(format!(
                "`world` has {} ranks, the mesh {}",
                world.world_size(),
                self.world
            )));
        }
        let rank = world.rank();
        world.split(self.color(rank, axes)?, self.key(rank, axes)?)
    }

    /// `rank`'s index along the data axes (context × data parallel): its rank in that group.
    pub fn data_rank(&self, rank: usize) -> usize {
        self.key(rank, &[Axis::Cp, Axis::Dp]).expect("dense axes")
    }

    /// How many ranks see different data: context × data parallel.
    pub fn data_size(&self) -> usize {
        self.size(Axis::Cp) * self.size(Axis::Dp)
    }

    /// In-process communicators for the groups over `axes`, one per world rank (rank `r`'s at
    /// index `r`), each of its group's size and its rank there.
    pub fn local_groups(&self, axes: &[Axis]) -> Result<Vec<LocalComm>> {
        let mut slots: Vec<Option<LocalComm>> = (0..self.world).map(|_| None).collect();
        for rank in 0..self.world {
            if slots[rank].is_some() {
                continue;
            }
            let members = self.members(rank, axes)?;
            for (comm, &member) in LocalComm::group(members.len())?.into_iter().zip(&members) {
                slots[member] = Some(comm);
            }
        }
        Ok(slots.into_iter().map(|c| c.expect("every rank is in a group")).collect())
    }

    fn view_of(&self, axes: &[Axis]) -> Result<View> {
        let dense = axes.iter().any(|&a| view(a).0 == View::Dense && a != Axis::Pp);
        let expert = axes.iter().any(|&a| view(a).0 == View::Expert && a != Axis::Pp);
        if dense && expert {
            return Err(Error::invalid(format!(
                "axes {axes:?} mix the dense view (Tp, Cp, Dp) with the expert one (Ep, Etp, Edp)"
            )));
        }
        Ok(if expert { View::Expert } else { View::Dense })
    }

    /// (tp, cp, dp, pp) of `rank`: mixed radix in the rank order.
    fn dense_coords(&self, rank: usize) -> [usize; 4] {
        let mut coords = [0; 4];
        let mut rest = rank;
        for axis in self.order {
            let i = view(axis).1;
            coords[i] = rest % self.dense[i];
            rest /= self.dense[i];
        }
        coords
    }

    /// (etp, ep, edp, pp) of `rank`: its index among the ranks of its stage in world order,
    /// expert-tensor fastest.
    fn expert_coords(&self, rank: usize) -> [usize; 4] {
        let pp = self.dense_coords(rank)[3];
        let index = (0..rank).filter(|&r| self.dense_coords(r)[3] == pp).count();
        let [etp, ep, _, _] = self.expert;
        [index % etp, index / etp % ep, index / (etp * ep), pp]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum View {
    Dense,
    Expert,
}

/// The view an axis belongs to and its index there (Pp: the dense one's, the same in both).
fn view(axis: Axis) -> (View, usize) {
    match axis {
        Axis::Tp => (View::Dense, 0),
        Axis::Cp => (View::Dense, 1),
        Axis::Dp => (View::Dense, 2),
        Axis::Pp => (View::Dense, 3),
        Axis::Etp => (View::Expert, 0),
        Axis::Ep => (View::Expert, 1),
        Axis::Edp => (View::Expert, 2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_order_puts_tensor_parallel_fastest() {
        // Megatron-Core, world 16, tp 2, pp 2, cp 1: tp groups [0,1],[2,3]...; dp groups
        // [0,2,4,6],[1,3,5,7],...; pp groups [0,8],[1,9],...
        let s = MeshShape::new(16, 2, 2, 1, 1, 1).unwrap();
        assert_eq!(s.size(Axis::Dp), 4);
        assert_eq!(s.members(5, &[Axis::Tp]).unwrap(), [4, 5]);
        assert_eq!(s.members(5, &[Axis::Dp]).unwrap(), [1, 3, 5, 7]);
        assert_eq!(s.members(5, &[Axis::Pp]).unwrap(), [5, 13]);
        assert_eq!(s.members(5, &[Axis::Tp, Axis::Pp]).unwrap(), [4, 5, 12, 13]);
        assert_eq!((s.data_rank(5), s.data_rank(4), s.data_size()), (2, 2, 4));
        assert_eq!(s.color(13, &[Axis::Dp]).unwrap(), 9);
    }

    #[test]
    fn experts_view_each_stage_with_expert_tensor_fastest() {
        // World 8, tp 2, dp 4 (one stage), ep 2, etp 1: the stage's 8 ranks as etp 1 x ep 2 x
        // edp 4, so ep groups [0,1],[2,3],... and edp groups [0,2,4,6],[1,3,5,7].
        let s = MeshShape::new(8, 2, 1, 1, 2, 1).unwrap();
        assert_eq!(s.size(Axis::Edp), 4);
        assert_eq!(s.members(3, &[Axis::Ep]).unwrap(), [2, 3]);
        assert_eq!(s.members(3, &[Axis::Edp]).unwrap(), [1, 3, 5, 7]);
        // Two stages of 4: the second stage's ranks 4..8 are counted from 0.
        let s = MeshShape::new(8, 1, 2, 1, 2, 1).unwrap();
        assert_eq!(s.members(6, &[Axis::Edp]).unwrap(), [4, 6]);
        assert_eq!(s.coord(6, Axis::Ep), 0);
        assert!(s.members(0, &[Axis::Ep, Axis::Tp]).is_err());
    }

    #[test]
    fn any_order_and_bad_sizes() {
        let s = MeshShape::new(4, 2, 1, 1, 1, 1).unwrap();
        let s = s.with_order([Axis::Dp, Axis::Tp, Axis::Cp, Axis::Pp]).unwrap();
        assert_eq!(s.members(0, &[Axis::Tp]).unwrap(), [0, 2]);
        assert_eq!(s.members(0, &[Axis::Dp]).unwrap(), [0, 1]);
        assert_eq!(s.data_rank(3), 1);
        assert!(MeshShape::new(6, 4, 1, 1, 1, 1).is_err());
        assert!(MeshShape::new(8, 1, 2, 1, 3, 1).is_err());
        assert!(s.with_order([Axis::Dp, Axis::Dp, Axis::Cp, Axis::Pp]).is_err());
    }

    #[test]
    fn axis_lists_parse_as_megatron_writes_them() {
        assert_eq!(Axis::parse_list("tp-cp-dp-pp").unwrap(), DENSE);
        assert_eq!(Axis::parse_list("edp").unwrap(), [Axis::Edp]);
        for bad in ["", "tp-", "tp-tp", "dp-xp", "TP"] {
            assert!(Axis::parse_list(bad).is_err(), "{bad}");
        }
        let s = MeshShape::new(8, 2, 2, 1, 1, 1).unwrap();
        assert_eq!((s.key(5, &[Axis::Dp]).unwrap(), s.key(5, &[Axis::Tp]).unwrap()), (0, 1));
        assert_eq!(s.key(7, &[Axis::Tp, Axis::Pp]).unwrap(), 3);
    }

    #[test]
    fn local_groups_give_each_rank_its_group() {
        let s = MeshShape::new(8, 2, 2, 1, 1, 1).unwrap();
        let dp = s.local_groups(&[Axis::Dp]).unwrap();
        for (r, c) in dp.iter().enumerate() {
            let members = s.members(r, &[Axis::Dp]).unwrap();
            assert_eq!(c.world_size(), members.len());
            assert_eq!(members[c.rank()], r);
        }
    }
}
