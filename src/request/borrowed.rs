//! Chat-completions and completions bodies read in one pass, without building a JSON tree:
//! the message texts are borrowed from the body (a completions prompt is copied straight
//! into the canonical bytes, token ids included), and what the router does not read is
//! skipped (with `parse`'s depth rule kept). Only small subtrees whose canonical bytes are their compact
//! JSON (tools, tool calls, content parts) become `Value`s. On success it gives exactly what
//! the tree walk gives; anything unusual (an error, an empty prompt, a wrong type, a
//! duplicate the tree would settle differently) returns `None`, and `parse` then walks the
//! tree, which names the error. Most of a warm request's parse time was building and
//! dropping that tree; and a tree of a completions body of token ids takes some twenty times
//! the body in memory, which a VM's linear memory keeps.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::{deeper_than, push_message, push_tools, Content, Fields, Message};

/// Depth below which the known fields sit (messages, a message, its content, a part):
/// with a smaller limit the tree walk decides.
const KNOWN_DEPTH: usize = 8;

/// A chat body: its fields, the prompt's canonical bytes, and whether the prompt has parts
/// that are not text; `None` when the tree walk must decide.
pub(super) fn chat(body: &[u8], max_depth: usize) -> Option<(Fields, Vec<u8>, bool)> {
    if max_depth < KNOWN_DEPTH {
        return None;
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let chat = ChatSeed { max_depth }.deserialize(&mut de).ok()?;
    de.end().ok()?;
    let Chat {
        head,
        messages,
        tools,
    } = chat;
    let fields = head.fields()?;
    let messages = messages.filter(|m| !m.is_empty())?;
    // Depths as the tree walk counts them: the body 0, `tools` 1, a message's fields 3.
    let too_deep = |v: &Value, depth: usize| deeper_than(v, max_depth - depth);
    if tools.as_ref().is_some_and(|t| too_deep(t, 1)) {
        return None;
    }
    let mut out = Vec::with_capacity(body.len());
    push_tools(tools.as_ref(), &mut out).ok()?;
    let mut media = false;
    for m in &messages {
        let parts_deep = match &m.content {
            Owned::Parts(p) => p.iter().any(|v| too_deep(v, 4)),
            _ => false,
        };
        if parts_deep || m.extras.iter().flatten().any(|v| too_deep(v, 3)) {
            return None;
        }
        media |= push_message(&m.view(), &mut out).ok()?;
    }
    Some((fields, out, media))
}

/// A completions body: its fields, the prompt's canonical bytes, and the number of token ids
/// when the prompt is ids; `None` when the tree walk must decide.
pub(super) fn completions(body: &[u8], max_depth: usize) -> Option<(Fields, Vec<u8>, Option<u64>)> {
    if max_depth < KNOWN_DEPTH {
        return None;
    }
    let mut out = Vec::with_capacity(body.len());
    let mut de = serde_json::Deserializer::from_slice(body);
    let c = CompletionsSeed {
        max_depth,
        out: &mut out,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    let ids = match c.prompt? {
        Prompt::Text => None,
        Prompt::Ids(0) => return None,
        Prompt::Ids(n) => Some(n),
    };
    Some((c.head.fields()?, out, ids))
}

/// The scheduling fields every body has, as read.
#[derive(Default)]
struct Head<'a> {
    model: Option<Cow<'a, str>>,
    stream: Option<bool>,
    /// `max_tokens`, `max_completion_tokens`, `max_output_tokens`: the first set counts.
    max_tokens: [Option<u64>; 3],
    cache_salt: Option<Cow<'a, str>>,
}

impl<'de> Head<'de> {
    /// Reads `key`'s value when it is one of these fields; false leaves it to the caller.
    fn read<A: MapAccess<'de>>(&mut self, key: &Key, map: &mut A) -> Result<bool, A::Error> {
        match *key {
            Key::Model => self.model = text(map)?,
            Key::Stream => self.stream = map.next_value()?,
            Key::MaxTokens(i) => {
                let v = map.next_value()?;
                if let Some(slot) = self.max_tokens.get_mut(i) {
                    *slot = v;
                }
            }
            Key::CacheSalt => self.cache_salt = text(map)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The fields; `None` without a model (the tree walk names the error).
    fn fields(self) -> Option<Fields> {
        Some(Fields {
            model: self.model.filter(|m| !m.is_empty())?.into_owned(),
            stream: self.stream.unwrap_or(false),
            max_tokens: self.max_tokens.into_iter().flatten().next(),
            cache_salt: self.cache_salt.map(Cow::into_owned),
        })
    }
}

#[derive(Default)]
struct Chat<'a> {
    head: Head<'a>,
    messages: Option<Vec<OwnedMessage<'a>>>,
    tools: Option<Value>,
}

struct OwnedMessage<'a> {
    role: Option<Cow<'a, str>>,
    content: Owned<'a>,
    /// `tool_calls`, `name`, `tool_call_id`, when set and not null.
    extras: [Option<Value>; 3],
}

enum Owned<'a> {
    Absent,
    Text(Cow<'a, str>),
    Parts(Vec<Value>),
}

impl OwnedMessage<'_> {
    fn view(&self) -> Message<'_> {
        Message {
            role: self.role.as_deref().unwrap_or_default(),
            content: match &self.content {
                Owned::Absent => Content::Absent,
                Owned::Text(t) => Content::Text(t),
                Owned::Parts(p) => Content::Parts(p),
            },
            extras: self.extras.each_ref().map(Option::as_ref),
        }
    }
}

/// A string, borrowed from the body unless it had escapes.
struct Text<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

fn text<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<Cow<'de, str>>, A::Error> {
    Ok(map.next_value::<Option<Text<'de>>>()?.map(|t| t.0))
}

/// A key, by what the router does with its value.
enum Key {
    Model,
    Stream,
    MaxTokens(usize),
    CacheSalt,
    Messages,
    Tools,
    Role,
    Content,
    Extra(usize),
    Prompt,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
                Ok(match s {
                    "model" => Key::Model,
                    "stream" => Key::Stream,
                    "max_tokens" => Key::MaxTokens(0),
                    "max_completion_tokens" => Key::MaxTokens(1),
                    "max_output_tokens" => Key::MaxTokens(2),
                    "cache_salt" => Key::CacheSalt,
                    "messages" => Key::Messages,
                    "tools" => Key::Tools,
                    "role" => Key::Role,
                    "content" => Key::Content,
                    "tool_calls" => Key::Extra(0),
                    "name" => Key::Extra(1),
                    "tool_call_id" => Key::Extra(2),
                    "prompt" => Key::Prompt,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

#[derive(Clone, Copy)]
struct ChatSeed {
    max_depth: usize,
}

impl<'de> DeserializeSeed<'de> for ChatSeed {
    type Value = Chat<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Chat<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ChatSeed {
    type Value = Chat<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a chat request")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Chat<'de>, A::Error> {
        let mut chat = Chat::default();
        while let Some(key) = map.next_key::<Key>()? {
            if chat.head.read(&key, &mut map)? {
                continue;
            }
            match key {
                Key::Messages => chat.messages = map.next_value_seed(MessagesSeed(self))?,
                Key::Tools => chat.tools = map.next_value()?,
                _ => map.next_value_seed(Skip(self.max_depth as isize - 1))?,
            }
        }
        Ok(chat)
    }
}

struct MessagesSeed(ChatSeed);

impl<'de> DeserializeSeed<'de> for MessagesSeed {
    type Value = Option<Vec<OwnedMessage<'de>>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed {
    type Value = Option<Vec<OwnedMessage<'de>>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("messages")
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut messages = Vec::with_capacity(seq.size_hint().unwrap_or(4).min(64));
        while let Some(m) = seq.next_element_seed(MessageSeed(self.0))? {
            messages.push(m);
        }
        Ok(Some(messages))
    }
}

struct MessageSeed(ChatSeed);

impl<'de> DeserializeSeed<'de> for MessageSeed {
    type Value = OwnedMessage<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MessageSeed {
    type Value = OwnedMessage<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut m = OwnedMessage {
            role: None,
            content: Owned::Absent,
            extras: [None, None, None],
        };
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Role => m.role = text(&mut map)?,
                Key::Content => m.content = map.next_value::<ContentValue>()?.0,
                Key::Extra(i) => {
                    let v = map.next_value()?;
                    if let Some(slot) = m.extras.get_mut(i) {
                        *slot = v;
                    }
                }
                // A message's fields sit at depth 3.
                _ => map.next_value_seed(Skip(self.0.max_depth as isize - 3))?,
            }
        }
        Ok(m)
    }
}

/// `content`: null, a string, or an array of parts; anything else is the tree walk's error.
struct ContentValue<'a>(Owned<'a>);

impl<'de> Deserialize<'de> for ContentValue<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContentValue<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("content")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(ContentValue(Owned::Absent))
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(ContentValue(Owned::Text(Cow::Borrowed(s))))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(ContentValue(Owned::Text(Cow::Owned(s.to_owned()))))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(v) = seq.next_element::<Value>()? {
                    parts.push(v);
                }
                Ok(ContentValue(Owned::Parts(parts)))
            }
        }
        d.deserialize_any(V)
    }
}

/// Skips a value the router does not read. `.0` is the depth budget the tree walk would
/// give it (`deeper_than(value, budget)`): a child of a value with none left is too deep.
#[derive(Clone, Copy)]
struct Skip(isize);

impl<'de> DeserializeSeed<'de> for Skip {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.0 < 0 {
            return Err(de::Error::custom("too deep"));
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Skip(self.0 - 1))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(Skip(self.0 - 1))?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Completions<'a> {
    head: Head<'a>,
    prompt: Option<Prompt>,
}

/// What a completions prompt was: text (one string, or strings joined by `RS`), or this
/// many token ids (4 bytes each).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Prompt {
    Text,
    Ids(u64),
}

/// Reads a completions body, the prompt written into `out` as it is read.
struct CompletionsSeed<'o> {
    max_depth: usize,
    out: &'o mut Vec<u8>,
}

impl<'de> DeserializeSeed<'de> for CompletionsSeed<'_> {
    type Value = Completions<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Completions<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for CompletionsSeed<'_> {
    type Value = Completions<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a completions request")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Completions<'de>, A::Error> {
        let mut c = Completions::default();
        while let Some(key) = map.next_key::<Key>()? {
            if c.head.read(&key, &mut map)? {
                continue;
            }
            match key {
                Key::Prompt => {
                    // A duplicate's last value counts, as in the tree: its bytes replace the
                    // first's.
                    self.out.clear();
                    c.prompt = Some(map.next_value_seed(PromptSeed(&mut *self.out))?);
                }
                _ => map.next_value_seed(Skip(self.max_depth as isize - 1))?,
            }
        }
        Ok(c)
    }
}

/// `prompt`: a non-empty string, or an array of strings, of token ids, or of arrays of
/// token ids. Anything else (null, empty, mixed) is the tree walk's error.
struct PromptSeed<'o>(&'o mut Vec<u8>);

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Prompt, E> {
        if s.is_empty() {
            return Err(E::custom("empty prompt"));
        }
        self.0.extend_from_slice(s.as_bytes());
        Ok(Prompt::Text)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let out = self.0;
        let (kind, mut ids) = seq
            .next_element_seed(Item {
                out: &mut *out,
                want: None,
            })?
            .ok_or_else(|| de::Error::custom("empty prompt"))?;
        // Every later item is of the first one's kind: a string, an id, or an array of ids.
        let want = Some(kind);
        while let Some((_, n)) = seq.next_element_seed(Item {
            out: &mut *out,
            want,
        })? {
            ids += n;
        }
        Ok(match kind {
            ItemKind::Text => Prompt::Text,
            ItemKind::Id | ItemKind::Ids => Prompt::Ids(ids),
        })
    }
}

#[derive(Clone, Copy, PartialEq)]
enum ItemKind {
    Text,
    Id,
    Ids,
}

/// One item of a prompt array, written into `out` (strings after the first one `RS` apart,
/// ids as 4 little-endian bytes); `want` is the first item's kind. Gives its kind and ids.
struct Item<'o> {
    out: &'o mut Vec<u8>,
    want: Option<ItemKind>,
}

impl Item<'_> {
    fn check<E: de::Error>(&self, kind: ItemKind) -> Result<(), E> {
        match self.want {
            Some(w) if w != kind => Err(E::custom("mixed prompt")),
            _ => Ok(()),
        }
    }
}

impl<'de> DeserializeSeed<'de> for Item<'_> {
    type Value = (ItemKind, u64);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Item<'_> {
    type Value = (ItemKind, u64);
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt item")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        self.check(ItemKind::Text)?;
        if self.want.is_some() {
            self.out.push(super::RS);
        }
        self.out.extend_from_slice(s.as_bytes());
        Ok((ItemKind::Text, 0))
    }
    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
        self.check(ItemKind::Id)?;
        let id = u32::try_from(n).map_err(E::custom)?;
        self.out.extend_from_slice(&id.to_le_bytes());
        Ok((ItemKind::Id, 1))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        self.check(ItemKind::Ids)?;
        let mut n = 0;
        while let Some(TokenId(id)) = seq.next_element()? {
            self.out.extend_from_slice(&id.to_le_bytes());
            n += 1;
        }
        Ok((ItemKind::Ids, n))
    }
}

/// A token id: an integer in `u32`.
struct TokenId(u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<TokenId, E> {
                u32::try_from(n).map(TokenId).map_err(E::custom)
            }
        }
        d.deserialize_u64(V)
    }
}
