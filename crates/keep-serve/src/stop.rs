//! Stop strings checked across token boundaries: [`StopMatcher`] holds back the end of the
//! generated text for as long as it could still be the start of a stop string, so that a stop
//! string split over several tokens is caught and never streamed, and text that turns out not
//! to be one is released unchanged.

/// The stop strings of one request and the text held back.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Add generated text; the text that may be sent now and whether a stop string was found
    /// (then the text before its first occurrence is what is sent, and generation ends).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail that is a prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, false)
    }

    /// The text still held back, released at the end of generation (no stop string came).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (t, stop) = m.push(p);
            out.push_str(&t);
            if stop {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn a_stop_split_over_tokens_is_caught() {
        assert_eq!(
            run(&["\n\n"], &["def f", "(x):", "\n", "\n", "more"]),
            ("def f(x):".into(), true)
        );
        assert_eq!(
            run(&["return"], &["  re", "tu", "rn x"]),
            ("  ".into(), true)
        );
    }

    #[test]
    fn text_that_only_looks_like_a_stop_is_released_whole() {
        assert_eq!(run(&["abc"], &["xa", "b", "d"]), ("xabd".into(), false));
        assert_eq!(run(&["abc"], &["ab"]), ("ab".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_nothing_after_it_is_sent() {
        assert_eq!(run(&["z", "bc"], &["abcz"]), ("a".into(), true));
        assert_eq!(run(&["é"], &["caf", "é!"]), ("caf".into(), true));
    }

    #[test]
    fn held_text_is_sent_as_soon_as_it_cannot_start_a_stop() {
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("abE"), ("ab".to_string(), false));
        assert_eq!(m.push("x"), ("Ex".to_string(), false));
        assert_eq!(m.push("EN"), ("".to_string(), false));
        assert_eq!(m.flush(), "EN");
    }
}
