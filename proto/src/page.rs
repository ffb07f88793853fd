//! Fitting a list reply into one NATS message: the coordinator answers `task.list` and
//! `fleet.jobs` with one message, and a server refuses a message over its `max_payload`
//! (1 MiB by default) — while one task's text may itself be up to 1 MiB
//! ([`crate::cluster::MAX_TASK_BYTES`]). So a list clips each long text field of each item
//! to [`FIELD_BYTES`] (the whole item is one `get` away: `mur task status`, `mur job
//! status`) and keeps as many items, in the list's order, as fit the budget; the reply
//! says when items were left out ([`Page::more`]) and which ones were clipped.

use serde::{Deserialize, Serialize};

/// The most bytes a text field of a listed item keeps (`text`, `result`, `error`); a
/// clipped field ends with [`CLIP_MARK`] after at most this many bytes of its text.
pub const FIELD_BYTES: usize = 4096;

/// What ends a clipped field.
pub const CLIP_MARK: &str = "…";

/// Room left in a reply for what wraps the items (the page's own fields, headers).
pub const REPLY_MARGIN: usize = 16 * 1024;

/// One reply of a list: the items that fit, in the list's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Page<T> {
    /// The items, in the list's order (each with its long fields clipped).
    pub items: Vec<T>,
    /// Whether items that matched were left out for the reply's size: the next ones in the
    /// list's order. Narrow the request (a state, a limit) to see them.
    pub more: bool,
    /// The ids of the items whose text fields were clipped to [`FIELD_BYTES`].
    pub clipped: Vec<String>,
}

/// Clips `text` to at most [`FIELD_BYTES`] bytes, cut on a character boundary, and marks it;
/// returns whether it was clipped.
pub fn clip(text: &mut String) -> bool {
    if text.len() <= FIELD_BYTES {
        return false;
    }
    let mut cut = FIELD_BYTES;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text.push_str(CLIP_MARK);
    true
}

/// [`clip`]s every one of `fields`; returns whether any was clipped.
pub fn clip_fields<'a>(fields: impl IntoIterator<Item = &'a mut String>) -> bool {
    fields.into_iter().fold(false, |any, field| clip(field) | any)
}

/// Builds the page of `items` (in the list's order) for a reply of at most `max_payload`
/// bytes: `clip_item` clips an item's text fields and answers its id when it clipped any;
/// items are kept, in order, while their JSON fits `max_payload − REPLY_MARGIN`.
pub fn fit<T: Serialize>(
    items: impl IntoIterator<Item = T>,
    max_payload: usize,
    mut clip_item: impl FnMut(&mut T) -> Option<String>,
) -> Page<T> {
    let budget = max_payload.saturating_sub(REPLY_MARGIN);
    let mut page = Page { items: Vec::new(), more: false, clipped: Vec::new() };
    // The ids of clipped items grow the reply too; they are counted with their item.
    let mut used = 0usize;
    for mut item in items {
        let clipped = clip_item(&mut item);
        let size = serde_json::to_vec(&item).map_or(usize::MAX, |j| j.len())
            + 1
            + clipped.as_ref().map_or(0, |id| id.len() + 3);
        if used.saturating_add(size) > budget {
            page.more = true;
            break;
        }
        used += size;
        page.items.push(item);
        page.clipped.extend(clipped);
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Item {
        id: String,
        text: String,
    }

    fn item(id: usize, text_bytes: usize) -> Item {
        Item { id: format!("i{id}"), text: "a".repeat(text_bytes) }
    }

    fn clip_text(i: &mut Item) -> Option<String> {
        clip(&mut i.text).then(|| i.id.clone())
    }

    #[test]
    fn a_long_field_is_cut_on_a_character_boundary_and_marked() {
        let mut short = "é".repeat(FIELD_BYTES / 2);
        assert!(!clip(&mut short), "exactly FIELD_BYTES bytes is kept");
        assert_eq!(short.len(), FIELD_BYTES);
        // One byte more, with a two-byte character across the limit: cut before it.
        let mut long = format!("a{}", "é".repeat(FIELD_BYTES / 2));
        assert!(clip(&mut long));
        assert_eq!(long.len(), FIELD_BYTES - 1 + CLIP_MARK.len());
        assert!(long.ends_with(&format!("é{CLIP_MARK}")));
    }

    #[test]
    fn items_are_kept_in_order_while_they_fit_and_the_rest_is_reported() {
        let max_payload = 1 << 20;
        // Each item of 1 MiB text is clipped to 4 KiB: a thousand of them do not fit.
        let page = fit((0..1000).map(|i| item(i, 1 << 20)), max_payload, clip_text);
        assert!(page.more);
        let json = serde_json::to_vec(&page.items).unwrap().len() + serde_json::to_vec(&page.clipped).unwrap().len();
        assert!(json <= max_payload - REPLY_MARGIN, "{json} bytes");
        assert!(page.items.len() > 200, "{} items", page.items.len());
        let ids: Vec<&str> = page.items.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids[..3], ["i0", "i1", "i2"]);
        assert_eq!(page.clipped.len(), page.items.len());
        assert!(page.items.iter().all(|i| i.text.len() == FIELD_BYTES + CLIP_MARK.len()));
        // Small items all fit, none clipped.
        let page = fit((0..1000).map(|i| item(i, 100)), max_payload, clip_text);
        assert_eq!((page.items.len(), page.more, page.clipped.len()), (1000, false, 0));
    }
}
